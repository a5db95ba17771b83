"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k router (optionally renormalised), dense layers
where `mlp_only_layers` / `decoder_sparse_step` say so."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..layers.attention import Attention, AttentionArgs, Positions, QKNorm, Scores
from ..layers.layers import MLP, DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import BaseArgs, CausalLM
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"num_local_experts": "num_experts"}

    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def is_sparse(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


def attention_args(a, bias: bool, qk_norm: QKNorm) -> AttentionArgs:
    window = a.sliding_window if a.use_sliding_window else None
    return AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                         Positions(rope_theta(a.raw or {}), rope_scaling(a.raw or {}), a.max_position_embeddings),
                         bias=bias, qk_norm=qk_norm, norm_eps=a.rms_norm_eps, scores=Scores(sliding_window=window))


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        attn = attention_args(a, a.attention_bias, QKNorm.HEAD)

        def mlp(i: int):
            if not a.is_sparse(i):
                return MLP(a.hidden_size, a.intermediate_size)
            return SparseMoE(TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
                             SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts))

        blocks = [DecoderBlock(Attention(attn), mlp(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


FAMILY = Family("qwen3_moe", ModelArgs, Model)
