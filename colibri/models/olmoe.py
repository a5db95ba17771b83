"""OLMoE: q/k RMSNorm over the whole projection, optional qkv clipping, softmax top-k router."""

from __future__ import annotations

from dataclasses import dataclass

from .base import BaseArgs, CausalLM
from .family import Family
from .layers import Attention, AttentionArgs, DecoderBlock, rope_scaling, rope_theta
from .moe import SparseMoE, SwitchGLU, TopKRouter


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"num_local_experts": "num_experts"}

    hidden_size: int
    intermediate_size: int
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


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        head_dim = a.hidden_size // a.num_attention_heads
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, head_dim,
                             rope_theta(a.raw or {}), rope_scaling(a.raw or {}), a.max_position_embeddings,
                             bias=a.attention_bias, qk_norm="full", norm_eps=a.rms_norm_eps, clip_qkv=a.clip_qkv)
        blocks = [
            DecoderBlock(
                Attention(attn),
                SparseMoE(TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
                          SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_experts)),
                a.hidden_size, a.rms_norm_eps)
            for i in range(a.num_hidden_layers)
        ]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


FAMILY = Family("olmoe", ModelArgs, Model)
