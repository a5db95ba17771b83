"""IBM Granite MoE with a shared expert (`granitemoeshared`): Granite 3.x MoE's layers (granitemoe.py) plus a
shared SwiGLU MLP per layer (`shared_intermediate_size`; 0: none) beside the routed experts, their sum times
`residual_multiplier`:

- the shared MLP's fused `input_linear` [2S, H] (gate rows, then up) reads as gate_proj / up_proj (`source_view`),
  its `output_linear` as down_proj, stored times `residual_multiplier` (`prepare`; the routed experts get it from
  the router's scale, as in granitemoe);
- the MoE block runs it as any shared expert (kernels/moe.c coli_moe_block at int8 / int4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..convert.safetensors_reader import SplitRows
from ..layers.layers import MLP
from ..layers.moe import SparseMoE
from . import granitemoe
from .family import Family

NAME = "granitemoeshared"
check_config = granitemoe.check_config


@dataclass
class ModelArgs(granitemoe.ModelArgs):
    shared_intermediate_size: int = 0


class Model(granitemoe.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        if a.shared_intermediate_size:
            for block in self.model.layers:
                block.mlp = SparseMoE(block.mlp.gate, block.mlp.experts, MLP(a.hidden_size, a.shared_intermediate_size),
                                      shared_name="shared_mlp")


def sanitize(name: str) -> str | None:
    """HF name (after `source_view`) -> canonical name: Granite's, and the shared MLP inside the MoE block."""
    name = granitemoe.sanitize(name)
    if ".shared_mlp." in name:
        name = name.replace(".shared_mlp.output_linear.", ".shared_mlp.down_proj.")
        name = name.replace(".shared_mlp.", ".mlp.shared_mlp.")
    return name


def source_view(st, cfg: dict):
    """Each shared `input_linear` [2S, H] as its gate rows and its up rows."""
    s = cfg.get("shared_intermediate_size") or 0
    split = {}
    for n in st.names():
        if n.endswith(".shared_mlp.input_linear.weight"):
            split[n.replace(".input_linear.", ".gate_proj.")] = (n, 0, s)
            split[n.replace(".input_linear.", ".up_proj.")] = (n, s, 2 * s)
    return SplitRows(st, split)


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Granite's folded multipliers, and the shared MLP's down_proj times `residual_multiplier`."""
    if name.endswith(".mlp.shared_mlp.down_proj.weight"):
        factor = float(cfg.get("residual_multiplier") or 1.0)
        return t if factor == 1.0 else (t.float() * factor).to(t.dtype)
    return granitemoe.prepare(name, t, cfg)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize,
                prepare=prepare)
