"""OLMoE (AllenAI's OLMoE-1B-7B and its instruct models): a Llama-shaped decoder whose every MLP is a mixture of
experts. One layer, for the step's rows h [T, hidden]:

    x = rms_norm(h)                                     input_layernorm
    q, k, v = x Wq, x Wk, x Wv                          [T, H*D], [T, Hkv*D] x2 (+ biases where attention_bias)
    q, k = rms_norm(q), rms_norm(k)                     over the whole projection, before the heads split
    q, k, v = clamp(q, k, v, -clip_qkv, clip_qkv)       only where the config sets clip_qkv
    q, k = rope(q), rope(k)                             rotate-half RoPE (rope_theta, rope_scaling)
    h = h + o_proj(causal_attention(q, k, v))           GQA, scale 1/sqrt(D), over the sequence's KV cache
    x = rms_norm(h)                                     post_attention_layernorm
    p = softmax(x Wr)                                   [T, E]; the k largest, renormalised where norm_topk_prob
    h = h + sum_j p_j down_j(silu(gate_j x) * up_j x)   the k routed experts, summed in f32

then a final RMSNorm and the head (base.py's `CausalLM`). The shared pieces are in colibri/layers/: `Attention`
(attention.py) with `QKNorm.FULL` and `Scores(clip_qkv=...)`, `TopKRouter`, `SwitchGLU` and `SparseMoE` (moe.py),
`DecoderBlock` (layers.py: the two residual adds). The checkpoint is in the canonical layout (each expert's gate_proj
and up_proj joined into one record by family.py's default `expert_record`), so the family declares no conversion
hook.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import Attention, AttentionArgs, Positions, QKNorm, Scores
from ..layers.layers import DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import BaseArgs, CausalLM
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"num_local_experts": "num_experts"}

    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    norm_topk_prob: bool = False
    clip_qkv: float | None = None
    attention_bias: bool = False
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads


def attention(a: ModelArgs) -> Attention:
    """Llama's attention with q and k RMS-normed over the whole projection, then optionally clipped."""
    head_dim = a.hidden_size // a.num_attention_heads
    return Attention(AttentionArgs(
        a.hidden_size, a.num_attention_heads, a.num_key_value_heads, head_dim,
        Positions(rope_theta(a.raw or {}), rope_scaling(a.raw or {}), a.max_position_embeddings),
        bias=a.attention_bias, qk_norm=QKNorm.FULL, norm_eps=a.rms_norm_eps, scores=Scores(clip_qkv=a.clip_qkv)))


def moe(a: ModelArgs, layer: int) -> SparseMoE:
    """Softmax over all experts, the top k kept (renormalised where norm_topk_prob), each a SwiGLU expert."""
    router = TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob)
    return SparseMoE(router, SwitchGLU(layer, a.hidden_size, a.intermediate_size, a.num_experts))


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        blocks = [DecoderBlock(attention(a), moe(a, i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


FAMILY = Family("olmoe", ModelArgs, Model)
