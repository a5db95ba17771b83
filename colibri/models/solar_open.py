"""Solar Open (`solar_open`: Upstage's Solar-Open-100B): GLM-4.5's MoE layers (glm4_moe.py: shared experts, the
sigmoid router with a selection-only bias and group-limited top-k) in every layer, no dense layer, under Llama's
attention: no q/k norm, q/k/v biases by `attention_bias` (o_proj none), RoPE over the whole head (GLM's default is
half; a `partial_rotary_factor` below 1 is refused: transformers' Solar Open cannot run one either). Tensor names
are GLM's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import glm4_moe
from .base import BaseArgs, refuse
from .family import Family

NAME = "solar_open"


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """GLM's fields with Solar Open's defaults (its config has no dense width, no dense layers, no q/k norm)."""

    max_position_embeddings: int = 131072
    first_k_dense_replace: int = 0
    use_qk_norm: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BaseArgs:
        # (no dense MLP anywhere: the width only has to exist)
        return super().from_dict({"intermediate_size": d.get("moe_intermediate_size", 1280), **d})

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # type: ignore[return-value]


def check_config(cfg: dict) -> None:
    """GLM's refusals (activation, scoring, top-k method, groups, rope types), plus Solar Open's layout."""
    glm4_moe.check_config(cfg, NAME)
    for key in ("first_k_dense_replace", "use_qk_norm"):
        if cfg.get(key):
            refuse(NAME, key, cfg[key], "Solar Open has every layer MoE and no q/k norm")
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        refuse(NAME, "partial_rotary_factor", factor, "RoPE over the whole head, as transformers' Solar Open")


class Model(glm4_moe.Model):
    pass


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config)
