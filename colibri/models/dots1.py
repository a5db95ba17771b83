"""dots.llm1 (rednote, 142B, 14B active): GLM-4.5's MoE layers (dense first layers, shared experts,
DeepSeek-V3's sigmoid router with a selection-only bias and group-limited top-k) under Qwen3's attention
(per-head q/k RMSNorm, RoPE over the whole head, no bias), optionally sliding-window attention from
layer `max_window_layers` on. Tensor names are GLM's (and DeepSeek-V3's): no remapping."""

from __future__ import annotations

from dataclasses import dataclass

from . import glm4_moe
from .base import refuse
from .family import Family


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """GLM's fields with dots.llm1's defaults."""

    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    use_qk_norm: bool = True  # (not a config field of dots1: its attention always norms q and k)
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # type: ignore[return-value]

    def window(self, i: int) -> int | None:
        """transformers' rule: layer i slides over `sliding_window` positions (4096 when absent, none when
        null) where its `layer_types` entry says so, or (without layer_types) from `max_window_layers` on."""
        raw = self.raw or {}
        size = raw.get("sliding_window", 4096)
        kinds = raw.get("layer_types")
        if kinds:
            return size if kinds[i] == "sliding_attention" else None
        start = raw.get("max_window_layers", 62)  # (transformers' default: the released depth)
        return size if size is not None and start is not None and i >= start else None


def check_config(cfg: dict) -> None:
    """GLM's refusals (activation, scoring, top-k method, groups, rope types), plus dots1's own."""
    glm4_moe.check_config(cfg, "dots1")
    if cfg.get("attention_bias"):
        refuse("dots1", "attention_bias", True, "the released models have none")
    kinds = cfg.get("layer_types")
    if kinds is not None and (len(kinds) != cfg.get("num_hidden_layers")
                              or any(k not in ("full_attention", "sliding_attention") for k in kinds)):
        refuse("dots1", "layer_types", kinds, "full_attention / sliding_attention, one per layer")


class Model(glm4_moe.Model):
    pass


FAMILY = Family("dots1", ModelArgs, Model, check_config=check_config)
