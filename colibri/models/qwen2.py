"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM: Qwen2.5-0.5B ... 72B, the dense siblings of Qwen2-MoE):
Qwen3's dense layers (qwen3.py: its sliding-window rule too) without the q/k norm, with biases on q, k and v
always (o_proj none; the config has no switch for them), heads of hidden / heads unless `head_dim` says."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import AttentionArgs, QKNorm, Scores
from . import qwen3
from .family import Family

NAME = "qwen2"


@dataclass
class ModelArgs(qwen3.ModelArgs):
    head_dim: int | None = None


def check_config(cfg: dict) -> None:
    qwen3.check_config(cfg, NAME)


class Model(qwen3.Model):
    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        return AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             cls.positions(a), bias=True, qk_norm=QKNorm.NONE, norm_eps=a.rms_norm_eps,
                             scores=Scores(sliding_window=a.window(i)))


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config)
