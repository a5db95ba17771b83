"""K-EXAONE (LG AI Research, `exaone_moe`, 236B with 23B active): EXAONE-4's attention over GLM-4.5's MoE
layers (the layers of glm4_moe.py, which dots1 shares):

- Attention: per-head q/k RMSNorm before RoPE (as Qwen3), no biases, the whole head rotated. Layers are
  `sliding_attention` or `full_attention` (`layer_types`; without it every `sliding_window_pattern`-th
  layer is full, transformers' rule); when a `sliding_window` is set, the full layers use no RoPE at all
  (EXAONE's "global NoPE"), the sliding ones RoPE over their window.
- MoE: DeepSeek-V3's sigmoid router with a selection-only bias and group-limited top-k, `num_shared_experts`
  always-on experts fused into one MLP, dense layers where `mlp_layer_types` says "dense" (else the first
  `first_k_dense_replace`).
- Converter: the router's `mlp.e_score_correction_bias` moves onto the router (`mlp.gate.`).
- The multi-token-prediction module (`mtp.*`) is Qwen3-Next's layout (fc, pre_fc_norm_embedding / _hidden,
  `mtp.layers.0`, norm) over one EXAONE layer with a dense MLP, sliding or full as `mtp_layer_types` says (its
  window `mtp_sliding_windows`); kept (layers/mtp.py `qwen_canonical`, `mtp_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import mtp
from . import glm4_moe
from .base import refuse
from .family import Family

NAME = "exaone_moe"
LAYER_KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """GLM's fields under EXAONE's names and defaults."""

    aliases = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}

    max_position_embeddings: int = 2048
    use_qk_norm: bool = True  # (not a config field: EXAONE's attention always norms q and k)
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    sliding_window: int | None = 4096
    sliding_window_pattern: int | str | None = 4
    layer_types: list | None = None
    mlp_layer_types: list | None = None

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # type: ignore[return-value]

    def kinds(self) -> list[str]:
        return attention_kinds(self.raw or {}, self.num_hidden_layers)

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.kinds()[i] == "sliding_attention" else None

    def rope_on(self, i: int) -> bool:
        return self.sliding_window is None or self.kinds()[i] == "sliding_attention"

    def is_moe(self, i: int) -> bool:
        return mlp_kinds(self.raw or {}, self.num_hidden_layers)[i] == "sparse"


def attention_kinds(cfg: dict, n: int) -> list[str]:
    """Per layer "sliding_attention" / "full_attention", as transformers' Exaone4Config decides."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    if cfg.get("sliding_window", 4096) is None:
        return ["full_attention"] * n
    every = cfg.get("sliding_window_pattern", 4)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


def mlp_kinds(cfg: dict, n: int) -> list[str]:
    if cfg.get("mlp_layer_types") is not None:
        return list(cfg["mlp_layer_types"])
    k = cfg.get("first_k_dense_replace", 1)
    return ["dense" if i < k else "sparse" for i in range(n)]


def check_config(cfg: dict) -> None:
    """GLM's refusals (activation, scoring, top-k method, groups, rope types), plus EXAONE's layer patterns."""
    glm4_moe.check_config({**cfg, "n_routed_experts": cfg.get("num_experts", 64)}, NAME)
    n = int(cfg.get("num_hidden_layers") or 0)
    every = cfg.get("sliding_window_pattern", 4)
    if cfg.get("layer_types") is None and cfg.get("sliding_window", 4096) is not None \
            and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        refuse(NAME, "sliding_window_pattern", every, "a positive integer, or give layer_types")
    kinds = attention_kinds(cfg, n)
    if len(kinds) != n or any(k not in LAYER_KINDS for k in kinds):
        refuse(NAME, "layer_types", cfg.get("layer_types"), "full_attention / sliding_attention, one per layer")
    mlps = mlp_kinds(cfg, n)
    if len(mlps) != n or any(k not in ("dense", "sparse") for k in mlps):
        refuse(NAME, "mlp_layer_types", cfg.get("mlp_layer_types"), '"dense" / "sparse", one per layer')
    if cfg.get("attention_bias"):
        refuse(NAME, "attention_bias", True, "EXAONE's projections have none")


class Model(glm4_moe.Model):
    pass


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the router's correction bias sits on the MoE block in the released
    checkpoints, on the router here; the multi-token-prediction module's names are Qwen3-Next's."""
    if name.startswith("mtp."):
        name = mtp.qwen_canonical(name.removeprefix("mtp."))
    return None if name is None else name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (its attention kind from `mtp_layer_types`, full where a config names none; a dense MLP) as
    layer 0 of a one-layer model. The model's `sliding_window` stays set where the MTP layer is full: it is what
    makes a full layer skip RoPE, as in the model's own full layers."""
    kind = (cfg.get("mtp_layer_types") or ["full_attention"])[0]
    out = {**cfg, "num_hidden_layers": 1, "layer_types": [kind], "mlp_layer_types": ["dense"]}
    windows = cfg.get("mtp_sliding_windows")
    if kind == "sliding_attention" and windows and isinstance(windows[0], int):
        out["sliding_window"] = windows[0]
    return out


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_config=mtp_config)
