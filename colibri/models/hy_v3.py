"""Tencent's Hy3 (`hy_v3`: Hy3-preview, 80 layers, 192 experts of which 8 are active): GLM-4.5's MoE layers
(glm4_moe.py) with Apertus' attention:

- Attention: per-head q/k RMSNorm before RoPE over the whole head, GQA, no biases by default; every layer full.
- MoE: a sigmoid router whose `e_score_correction_bias` only picks the experts (one group), the chosen scores
  renormalised and times `router_scaling_factor`; `num_shared_experts` always-on experts fused into one MLP
  (added in f32 when `enable_moe_fp32_combine`: colibri sums in f32 anyway); dense layers where
  `mlp_layer_types` says "dense" (transformers' default: layer 0).
- Converter: the release's names (`mlp.router.gate`, `mlp.expert_bias`, `mlp.shared_mlp`) map to GLM's, the
  correction bias onto the router.
- The multi-token-prediction layer the release ships past the decoder stack (`model.layers.80.*`: DeepSeek-V3's
  layout, an MoE layer, its norm `final_layernorm`, a copy of the head as `shared_head.weight`) is kept
  (layers/mtp.py, `mtp_config`), counted by `num_nextn_predict_layers` or, where transformers' config has no such
  field, by `MTP_LAYERS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import glm4_moe
from .base import refuse, rename_first
from .family import Family

NAME = "hy_v3"
# The release's multi-token-prediction layer is one extra decoder layer after the stack (transformers ignores
# `model.layers.80.*`).
MTP_LAYERS = 1


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """GLM's fields under Hy3's names and defaults."""

    aliases = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
               "router_scaling_factor": "routed_scaling_factor"}
    default_theta = 11_158_840.0  # (transformers' HYV3Config.default_theta, for a config without rope_parameters)

    max_position_embeddings: int = 131072
    use_qk_norm: bool = True  # (not a config field: Apertus' attention always norms q and k)
    routed_scaling_factor: float = 2.826
    mlp_layer_types: list | None = None

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # type: ignore[return-value]

    def is_moe(self, i: int) -> bool:
        return mlp_kinds(self.raw or {}, self.num_hidden_layers)[i] == "sparse"


def mlp_kinds(cfg: dict, n: int) -> list[str]:
    """Per layer "dense" / "sparse", as transformers' HYV3Config decides (without a list: layer 0 dense)."""
    if cfg.get("mlp_layer_types") is not None:
        return list(cfg["mlp_layer_types"])
    return ["dense" if i == 0 else "sparse" for i in range(n)]


def check_config(cfg: dict) -> None:
    """GLM's refusals (activation, rope types), plus Hy3's layer pattern and its one-group router."""
    glm4_moe.check_config({**cfg, "n_routed_experts": cfg.get("num_experts", 192)}, NAME)
    for field in ("n_group", "topk_group"):  # (Hy3's router has no groups: a config that sets them is not Hy3's)
        if (cfg.get(field) or 1) != 1:
            refuse(NAME, field, cfg[field], "Hy3's router picks from all experts (one group)")
    if float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(NAME, "partial_rotary_factor", cfg["rope_parameters"]["partial_rotary_factor"],
               "Hy3 rotates the whole head")
    if int(cfg.get("num_shared_experts", 1)) < 1:  # (transformers would then build a full-width dense MLP)
        refuse(NAME, "num_shared_experts", cfg["num_shared_experts"], "at least 1, as released")
    if cfg.get("mlp_bias"):
        refuse(NAME, "mlp_bias", True, "Hy3's MLPs and experts have no biases")
    n = int(cfg.get("num_hidden_layers") or 0)
    mlps = mlp_kinds(cfg, n)
    if len(mlps) != n or any(k not in ("dense", "sparse") for k in mlps):
        refuse(NAME, "mlp_layer_types", cfg.get("mlp_layer_types"), '"dense" / "sparse", one per layer')


class Model(glm4_moe.Model):
    pass


_HUB_NAMES = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
              (".mlp.shared_mlp.", ".mlp.shared_experts."),
              # transformers' in-memory names (a fused state_dict saved verbatim)
              (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the release's router is `mlp.router.gate`, its correction bias `mlp.expert_bias`
    (on the MoE block in transformers too; on the router here), its shared expert `mlp.shared_mlp` (the MTP layer's
    own names: layers/mtp.py `canonical`)."""
    return rename_first(name, _HUB_NAMES)


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (routed, as the release's layers past the first) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "mlp_layer_types": ["sparse"]}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_layers=MTP_LAYERS,
                mtp_config=mtp_config)
