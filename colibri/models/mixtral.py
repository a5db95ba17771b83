"""Mixtral: GQA attention + softmax top-k router (renormalised) over SwiGLU experts. Released Mixtrals ship no
multi-token-prediction layer; the built-in demo's (tools/make_demo_mtp.py) is one more Mixtral layer in
DeepSeek-V3's MTP layout (`mtp_config`, layers/mtp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layers.attention import Attention, AttentionArgs, Positions, Scores
from ..layers.layers import DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import BaseArgs, CausalLM
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768
    sliding_window: int | None = None
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads


class Model(CausalLM):
    """Mixtral's skeleton; the families built on it (phimoe, granitemoe, dbrx, ...) swap its attention settings and
    router."""

    def __init__(self, a: ModelArgs):
        blocks = [
            DecoderBlock(
                Attention(self.attention_args(a, i)),
                SparseMoE(self.router(a), SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_local_experts)),
                a.hidden_size, a.rms_norm_eps)
            for i in range(a.num_hidden_layers)
        ]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a

    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        """Layer i's attention settings."""
        return AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(a.raw or {}, 1e6), rope_scaling(a.raw or {}),
                                       a.max_position_embeddings), norm_eps=a.rms_norm_eps,
                             scores=Scores(sliding_window=a.sliding_window))

    @classmethod
    def router(cls, a: ModelArgs) -> nn.Module:
        return TopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, True)


def sanitize(name: str) -> str | None:
    """HF name -> canonical name (Mixtral calls its MoE block `block_sparse_moe`)."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def mtp_config(cfg: dict) -> dict:
    """An MTP layer (the demo's) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1}


FAMILY = Family("mixtral", ModelArgs, Model, sanitize=sanitize, mtp_config=mtp_config)
