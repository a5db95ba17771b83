"""MiMo-V2-Flash (`mimo_v2_flash`, Xiaomi, 309B with 15B active): GQA attention with values narrower than the
queries and keys (192 / 128 wide), mostly sliding-window layers, and DeepSeek-V3's sigmoid router over experts
without a shared one.

- Layers are `full_attention` (layer 0 and every sixth) or `sliding_attention` (`layer_types`); a sliding layer
  has twice the KV heads, a per-head attention sink (gpt-oss's) and a window of `sliding_window` positions
  (`sliding_window_size` + 1 where a config gives that, transformers' rule).
- Each layer type has its own RoPE (`rope_parameters[type]`: theta and `partial_rotary_factor`, 0.334 of the head;
  without `rope_parameters` transformers' defaults, the released model's thetas).
- Values are multiplied by `attention_value_scale` before they are cached.
- MoE layers by `mlp_layer_types` (else all but the first); the router is GLM's / DeepSeek-V3's (selection bias,
  groups, renormalised, times `routed_scaling_factor`, which a released config leaves null: 1.0).
- The hub's `self_attn.attention_sink_bias` is the sinks.
- The multi-token-prediction layers (`model.mtp.layers.{j}.*`, `num_nextn_predict_layers` of them: enorm, hnorm,
  eh_proj, one sliding-window layer with sinks and a dense MLP whose `pre_mlp_layernorm` is the usual
  post-attention norm, `final_layernorm`) are kept (layers/mtp.py, `mtp_config`; `--spec mtp` chains the first).
Decode takes the fused native blocks layer by layer (kernels/block.c with the values' width and scale); the
one-call step needs one RoPE table for all layers, which the released model's two thetas rule out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..layers import mtp
from ..layers.attention import Attention, AttentionArgs, Positions, Scores, Values
from ..layers.layers import MLP, DecoderBlock
from ..layers.moe import SparseMoE, SwitchGLU
from . import glm4_moe
from .base import CausalLM, check_act_and_rope, refuse
from .family import Family
from .glm4_moe import GroupLimitedRouter

NAME = "mimo_v2_flash"
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(glm4_moe.ModelArgs):
    """GLM's fields (its router's) with MiMo-V2-Flash's defaults, and its own."""

    num_key_value_heads: int | None = 4
    head_dim: int | None = 192
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    routed_scaling_factor: float | None = 1.0
    v_head_dim: int = 128
    sliding_window: int = 129
    attention_value_scale: float | None = 0.707
    layer_types: list | None = None
    mlp_layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        raw = self.raw or {}
        if raw.get("sliding_window_size") is not None:  # (the released config's name: the window minus the query)
            self.sliding_window = int(raw["sliding_window_size"]) + 1
        if self.routed_scaling_factor is None:
            self.routed_scaling_factor = 1.0
        if self.attention_value_scale is None:
            self.attention_value_scale = 1.0

    def kinds(self) -> list[str]:
        return attention_kinds(self.layer_types, self.num_hidden_layers)

    def is_moe(self, i: int) -> bool:
        types = self.mlp_layer_types or ["dense"] + ["sparse"] * (self.num_hidden_layers - 1)
        return types[i] == "sparse"

    def rope(self, kind: str) -> dict:
        params = (self.raw or {}).get("rope_parameters") or ROPE_DEFAULTS
        return params[kind]


def attention_kinds(given: list | None, n: int) -> list[str]:
    """transformers' rule: `layer_types`, else full attention at layer 0 and every sixth."""
    if given is not None:
        return list(given)
    return ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention" for i in range(n)]


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        def attn(i: int) -> Attention:
            sliding = a.kinds()[i] == "sliding_attention"
            r = a.rope(a.kinds()[i])
            scaling = None if r.get("rope_type", "default") == "default" else {**r, "rope_type": r["rope_type"]}
            rotary = int(a.head_dim * r.get("partial_rotary_factor", 0.334))
            return Attention(AttentionArgs(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads * (2 if sliding else 1), a.head_dim,
                Positions(float(r["rope_theta"]), scaling, a.max_position_embeddings, rotary_dim=rotary),
                bias=a.attention_bias, norm_eps=a.rms_norm_eps,
                scores=Scores(sliding_window=a.sliding_window if sliding else None, sinks=sliding),
                values=Values(v_head_dim=a.v_head_dim, v_scale=a.attention_value_scale)))

        def mlp(i: int) -> nn.Module:
            if not a.is_moe(i):
                return MLP(a.hidden_size, a.intermediate_size)
            gate = GroupLimitedRouter(a.hidden_size, a.n_routed_experts, a.num_experts_per_tok, a.n_group,
                                      a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
            return SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.n_routed_experts))

        blocks = [DecoderBlock(attn(i), mlp(i), a.hidden_size, a.rms_norm_eps) for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict) -> None:
    check_act_and_rope(NAME, {k: v for k, v in cfg.items() if k != "rope_parameters"})
    n = int(cfg.get("num_hidden_layers") or 0)
    kinds = attention_kinds(cfg.get("layer_types"), n)
    if len(kinds) != n or any(k not in KINDS for k in kinds):
        refuse(NAME, "layer_types", cfg.get("layer_types"), "full_attention / sliding_attention, one per layer")
    mlps = cfg.get("mlp_layer_types")
    if mlps is not None and (len(mlps) != n or any(k not in ("dense", "sparse") for k in mlps)):
        refuse(NAME, "mlp_layer_types", mlps, '"dense" / "sparse", one per layer')
    params = cfg.get("rope_parameters") or ROPE_DEFAULTS
    for kind in set(kinds):
        r = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(r, dict) or not isinstance(r.get("rope_theta"), int | float):
            refuse(NAME, f"rope_parameters.{kind}", r, "a rope_theta for each layer type")
        if r.get("rope_type", "default") != "default":
            refuse(NAME, f"rope_parameters.{kind}.rope_type", r.get("rope_type"), "default")
        if int(int(cfg.get("head_dim", 192)) * r.get("partial_rotary_factor", 0.334)) % 2:
            refuse(NAME, "partial_rotary_factor", r.get("partial_rotary_factor"),
                   "an even number of rotated channels")
    experts, groups = int(cfg.get("n_routed_experts") or 256), int(cfg.get("n_group") or 1)
    if experts % groups or experts // groups < 2:
        refuse(NAME, "n_group", groups, f"must split the {experts} experts into groups of >= 2")


MTP = re.compile(r"model\.mtp\.layers\.(\d+)\.(.+)")
MTP_MLP_NORM = "pre_mlp_layernorm."  # (the release's post-attention norm of its MTP layers; else DeepSeek's names)


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the released checkpoints' `attention_sink_bias` is the sinks; the
    multi-token-prediction layers' names become the container's `mtp.{j}.*`."""
    name = name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
    if m := MTP.fullmatch(name):
        rest = m[2]
        if rest.startswith(MTP_MLP_NORM):
            rest = "post_attention_layernorm." + rest.removeprefix(MTP_MLP_NORM)
        return mtp.canonical(rest, int(m[1]))
    return None if name.startswith("model.mtp.") else name


def mtp_config(cfg: dict) -> dict:
    """An MTP layer (a sliding-window layer with sinks, a dense MLP of `intermediate_size`) as layer 0 of a
    one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["dense"]}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_config=mtp_config)
