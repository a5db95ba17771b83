"""JetBrains' Mellum 2 (`mellum`: Mellum2-12B-A2.5B): Qwen3-MoE's layers (per-head q/k RMSNorm, the softmax top-k
router, renormalised by default) with a RoPE per layer type:

- `layer_types`: sliding layers attend over the last `sliding_window` positions (default: every layer full);
  each type has its own RoPE base (`rope_parameters` keyed by layer type; without it transformers' defaults,
  500000 for the full layers and 10000 for the sliding ones), over the whole head.
- `mlp_layer_types`: "dense" layers have an MLP of `intermediate_size` (default: every layer sparse).
- The multi-token-prediction module (`mtp.*`, `num_mtp_layers`, at most one: transformers' MtpModel) is Qwen3-Next's
  layout (fc, pre_fc_norm_embedding / _hidden, `mtp.layers.0`, norm) over one Mellum layer of the kinds
  `mtp_layer_types` / `mtp_mlp_layer_types` name (transformers' defaults: sliding, sparse); kept (layers/mtp.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layers import mtp
from ..layers.attention import Attention, QKNorm
from ..layers.layers import MLP, DecoderBlock
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from . import qwen3_moe
from .base import CausalLM, check_act_and_rope, refuse
from .family import Family

NAME = "mellum"
KINDS = ("full_attention", "sliding_attention")
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    """Qwen3-MoE's fields with Mellum's defaults and its per-layer lists."""

    max_position_embeddings: int = 131072
    norm_topk_prob: bool = True
    sliding_window: int | None = 1024
    layer_types: list | None = None
    mlp_layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        n = self.num_hidden_layers
        self.layer_types = self.layer_types or ["full_attention"] * n
        self.mlp_layer_types = self.mlp_layer_types or ["sparse"] * n

    def rope(self, kind: str) -> dict:
        params = (self.raw or {}).get("rope_parameters") or ROPE_DEFAULTS
        return params[kind]


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        base = qwen3_moe.attention_args(a, False, QKNorm.HEAD)

        def attn(i: int) -> Attention:
            kind = a.layer_types[i]  # type: ignore[index]
            return Attention(dataclasses.replace(
                base, positions=dataclasses.replace(base.positions, rope_theta=float(a.rope(kind)["rope_theta"]),
                                                    rope_scaling=None),
                scores=dataclasses.replace(base.scores,
                                           sliding_window=a.sliding_window if kind == "sliding_attention" else None)))

        def mlp(i: int):
            if a.mlp_layer_types[i] == "dense":  # type: ignore[index]
                return MLP(a.hidden_size, a.intermediate_size)
            return SparseMoE(TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
                             SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts))

        blocks = [DecoderBlock(attn(i), mlp(i), a.hidden_size, a.rms_norm_eps) for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Mellum configs this file does not implement: another activation, layer lists that do not name one
    valid kind per layer, sliding layers without a window, a layer type without its own plain RoPE base, biases."""
    check_act_and_rope(NAME, {k: v for k, v in cfg.items() if k != "rope_parameters"})
    n = int(cfg.get("num_hidden_layers") or 0)
    kinds = cfg.get("layer_types") or ["full_attention"] * n
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds):
        refuse(NAME, "layer_types", cfg.get("layer_types"), f"{n} entries of {' / '.join(KINDS)}")
    mlps = cfg.get("mlp_layer_types")
    if mlps is not None and (not isinstance(mlps, list) or len(mlps) != n
                             or any(k not in ("dense", "sparse") for k in mlps)):
        refuse(NAME, "mlp_layer_types", mlps, f'{n} entries of "dense" / "sparse"')
    if "sliding_attention" in kinds and not cfg.get("sliding_window", 1024):
        refuse(NAME, "sliding_window", cfg.get("sliding_window"), "a window of at least 1 for the sliding layers")
    params = cfg.get("rope_parameters") or ROPE_DEFAULTS
    for kind in sorted(set(kinds)):
        r = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(r, dict) or not isinstance(r.get("rope_theta"), int | float):
            refuse(NAME, f"rope_parameters.{kind}", r, "a rope_theta for each layer type")
        if r.get("rope_type", "default") != "default":
            refuse(NAME, f"rope_parameters.{kind}.rope_type", r.get("rope_type"), "default")
        if r.get("partial_rotary_factor", 1.0) != 1.0:  # (transformers' Mellum rotates whole heads only)
            refuse(NAME, f"rope_parameters.{kind}.partial_rotary_factor", r["partial_rotary_factor"], "1.0")
    if cfg.get("attention_bias"):
        refuse(NAME, "attention_bias", True, "Mellum's projections have no biases")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the multi-token-prediction module's names are Qwen3-Next's."""
    if name.startswith("mtp."):
        return mtp.qwen_canonical(name.removeprefix("mtp."))
    return None if name.startswith("model.mtp.") else name


def mtp_config(cfg: dict) -> dict:
    """The MTP layer as layer 0 of a one-layer model, of the kinds the config names (transformers' defaults)."""
    kind = (cfg.get("mtp_layer_types") or ["sliding_attention"])[0]
    mlp = (cfg.get("mtp_mlp_layer_types") or ["sparse"])[0]
    return {**cfg, "num_hidden_layers": 1, "layer_types": [kind], "mlp_layer_types": [mlp]}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_config=mtp_config)
