"""Qwen3 (transformers' Qwen3ForCausalLM: Qwen3-0.6B ... 32B, the draft models of Qwen3-30B-A3B and -235B-A22B):
Llama's dense skeleton (llama.py) with Qwen3-MoE's attention, a per-head q/k RMSNorm before RoPE, biases on q, k,
v and o by `attention_bias` (the released models have none), heads of `head_dim` (128 where the config has none,
as transformers; not hidden / heads), and sliding layers by transformers' rule (`window`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import AttentionArgs, Output, QKNorm, Scores
from . import llama
from .base import refuse
from .family import Family

NAME = "qwen3"


@dataclass
class ModelArgs(llama.ModelArgs):
    head_dim: int | None = 128
    max_position_embeddings: int = 32768

    def window(self, i: int) -> int | None:
        """transformers' rule: with `use_sliding_window`, layer i slides over `sliding_window` positions where its
        `layer_types` entry says so, or (without layer_types) from `max_window_layers` on."""
        raw = self.raw or {}
        size = raw.get("sliding_window", 4096) if raw.get("use_sliding_window") else None
        kinds = raw.get("layer_types")
        if size is None:
            return None
        if kinds:
            return size if kinds[i] == "sliding_attention" else None
        return size if i >= raw.get("max_window_layers", 28) else None


def check_config(cfg: dict, name: str = NAME) -> None:
    """Llama's refusals, plus layer lists transformers would not read."""
    llama.check_config(cfg, name)
    kinds = cfg.get("layer_types")
    if kinds is not None and (len(kinds) != cfg.get("num_hidden_layers")
                              or any(k not in ("full_attention", "sliding_attention") for k in kinds)):
        refuse(name, "layer_types", kinds, "full_attention / sliding_attention, one per layer")


class Model(llama.Model):
    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        return AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             cls.positions(a), bias=a.attention_bias, qk_norm=QKNorm.HEAD, norm_eps=a.rms_norm_eps,
                             scores=Scores(sliding_window=a.window(i)), output=Output(o_bias=a.attention_bias))


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config)
