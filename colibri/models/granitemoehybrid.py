"""IBM Granite 4.0-H (`granitemoehybrid`: granite-4.0-h-tiny, -small): Granite's MoE layers with a shared expert
(granitemoeshared.py: its four multipliers folded where the kernels have a place for them) under two kinds of
mixer, by `layer_types` (or the release's `layers_block_type`; "mamba" / "attention" are the older names):

- "linear_attention": a Mamba-2 mixer (mamba2.py), `mamba_n_heads` heads of `mamba_d_head` channels, groups of
  `mamba_d_state` states, a causal convolution of `mamba_d_conv` taps; its out_proj is stored times
  `residual_multiplier` (`prepare`), as attention's o_proj is;
- "full_attention": Granite's attention, RoPE only where `position_embedding_type` is "rope" (the releases use
  none: "nope").

The Mamba layers' states replace their KV caches, so prompt caching stays off (linear_attn.py). Their decode rows
take kernels/mamba.c, the attention and MoE blocks the kernels' blocks, layer by layer (the one-call step needs one
mixer kind).
Checkpoints without routed experts (granite-4.0-h-micro, dense) are refused: colibri runs MoE models.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..layers.attention import AttentionArgs
from ..layers.mamba2 import Mamba2Args, Mamba2Mixer
from . import granitemoe, granitemoeshared
from .base import LEGACY_KINDS, refuse, rename_first
from .family import Family

NAME = "granitemoehybrid"
source_view = granitemoeshared.source_view
KINDS = ("linear_attention", "full_attention")


def time_step_limit(cfg: dict) -> list | None:
    """`time_step_limit` with transformers' tags for non-finite floats (`{"__float__": "Infinity"}`, how it
    writes the default's upper bound to config.json) read as floats."""
    limit = cfg.get("time_step_limit")
    if not isinstance(limit, list | tuple):
        return limit
    tags = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
    return [tags.get(v.get("__float__"), v) if isinstance(v, dict) and len(v) == 1 else v for v in limit]


def layer_kinds(cfg: dict) -> list:
    """The config's layer list in transformers' names (every layer Mamba where it gives none, as transformers)."""
    kinds = cfg.get("layer_types", cfg.get("layers_block_type"))
    if kinds is None:
        return ["linear_attention"] * (cfg.get("num_hidden_layers") or 0)
    return [LEGACY_KINDS.get(k, k) for k in kinds] if isinstance(kinds, list) else kinds


@dataclass
class ModelArgs(granitemoeshared.ModelArgs):
    shared_intermediate_size: int = 1024
    position_embedding_type: str | None = None
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    def mamba_args(self) -> Mamba2Args:
        inner = self.mamba_expand * self.hidden_size
        head = inner // self.mamba_n_heads if self.mamba_d_head == "auto" else int(self.mamba_d_head)
        lo, hi = time_step_limit(self.raw or {}) or (0.0, math.inf)
        return Mamba2Args(self.hidden_size, self.mamba_n_heads, head, self.mamba_d_state, self.mamba_n_groups,
                          self.mamba_d_conv, self.mamba_chunk_size, self.rms_norm_eps, self.mamba_conv_bias,
                          self.mamba_proj_bias, (float(lo), float(hi)))


class Model(granitemoeshared.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        for block, kind in zip(self.model.layers, layer_kinds(a.raw or {}), strict=True):
            if kind == "linear_attention":
                block.self_attn = Mamba2Mixer(a.mamba_args())

    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        args = super().attention_args(a, i)
        return dataclasses.replace(
            args, positions=dataclasses.replace(args.positions, use_rope=a.position_embedding_type == "rope"))


def check_config(cfg: dict) -> None:
    """Granite's refusals, a layer list of one valid kind a layer, a Mamba shape that divides, no experts."""
    granitemoe.check_config(cfg)
    n = cfg.get("num_hidden_layers")
    kinds = layer_kinds(cfg)
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds):
        refuse(NAME, "layer_types", cfg.get("layer_types", cfg.get("layers_block_type")),
               f"{n} entries of {' / '.join(KINDS)} (or mamba / attention)")
    if not cfg.get("num_local_experts", 8):
        refuse(NAME, "num_local_experts", cfg["num_local_experts"], "routed experts (a dense Granite 4.0-H is not "
                                                                      "a mixture-of-experts model)")
    if cfg.get("position_embedding_type") not in (None, "nope", "rope"):
        refuse(NAME, "position_embedding_type", cfg["position_embedding_type"], "none, nope or rope")
    heads, groups = cfg.get("mamba_n_heads", 128), cfg.get("mamba_n_groups", 1)
    inner = cfg.get("mamba_expand", 2) * cfg.get("hidden_size", 0)
    head = cfg.get("mamba_d_head", "auto")
    for key, v in (("mamba_n_heads", heads), ("mamba_n_groups", groups), ("mamba_d_state", cfg.get("mamba_d_state", 1)),
                   ("mamba_expand", cfg.get("mamba_expand", 2)), ("mamba_chunk_size", cfg.get("mamba_chunk_size", 1))):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            refuse(NAME, key, v, "a positive integer")
    if inner % heads or (head != "auto" and head * heads != inner):
        refuse(NAME, "mamba_d_head", head, f"mamba_expand * hidden_size / mamba_n_heads = {inner / heads:g}")
    if heads % groups:
        refuse(NAME, "mamba_n_groups", groups, f"a divisor of mamba_n_heads ({heads})")
    k = cfg.get("mamba_d_conv", 4)
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        refuse(NAME, "mamba_d_conv", k, "an integer of at least 2 (a convolution over past inputs)")
    limit = time_step_limit(cfg)
    numbers = isinstance(limit, list | tuple) and all(isinstance(t, int | float) and not isinstance(t, bool)
                                                      for t in limit)
    if limit is not None and not (numbers and len(limit) == 2 and 0 <= limit[0] <= limit[1]):
        refuse(NAME, "time_step_limit", limit, "[low, high] with 0 <= low <= high")


def sanitize(name: str) -> str | None:
    """HF name (after `source_view`) -> canonical name: Granite's, a Mamba layer's mixer under `self_attn`."""
    return granitemoeshared.sanitize(rename_first(name, ((".mamba.", ".self_attn."),)))


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Granite's folded multipliers; a Mamba layer's out_proj times `residual_multiplier` as o_proj is."""
    if name.endswith(".self_attn.out_proj.weight") or name.endswith(".self_attn.out_proj.bias"):
        factor = float(cfg.get("residual_multiplier") or 1.0)
        return t if factor == 1.0 else (t.float() * factor).to(t.dtype)
    return granitemoeshared.prepare(name, t, cfg)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize,
                prepare=prepare)
