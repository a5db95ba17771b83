"""Qwen2-MoE: q/k/v bias, softmax top-k router, plus a shared expert behind a sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import Attention, QKNorm
from ..layers.layers import MLP, DecoderBlock, Linear
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import CausalLM
from .family import Family
from .qwen3_moe import ModelArgs as _Qwen3Args
from .qwen3_moe import attention_args


@dataclass
class ModelArgs(_Qwen3Args):
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = True


def mlp(a: ModelArgs, i: int) -> MLP | SparseMoE:
    """Layer i's feed-forward: a dense MLP, or the routed experts plus the sigmoid-gated shared expert (Qwen2-MoE's,
    which Qwen3-Next and Qwen3.5 keep)."""
    if not a.is_sparse(i):
        return MLP(a.hidden_size, a.intermediate_size)
    shared = MLP(a.hidden_size, a.shared_expert_intermediate_size)
    return SparseMoE(TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
                     SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts),
                     shared, Linear(a.hidden_size, 1))


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        attn = attention_args(a, a.qkv_bias, QKNorm.NONE)
        blocks = [DecoderBlock(Attention(attn), mlp(a, i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


FAMILY = Family("qwen2_moe", ModelArgs, Model)
