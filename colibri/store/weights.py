"""WeightStore: builds the modules and tensors a model binds to, from a container.

Dense weights are zero-copy views into the container's mapping (float) or fused-kernel
modules over them (int8; int4 repacks once). `expert_weights` builds one routed expert's
modules over its record's bytes; where those bytes live is the tiered store's business.
"""

from __future__ import annotations

import torch

from ..errors import ColibriError
from ..format.container import Container
from ..layers.moe import ExpertWeights
from ..quant import QLinear, stored_linear


def expert_weights(views: dict[str, torch.Tensor], infos: dict[str, dict], compute_dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> ExpertWeights:
    """ExpertWeights from a record's member views (sub-name -> tensor)."""
    def lin(part: str) -> QLinear:
        w = f"{part}.weight"
        tensors = {s: views[w + s].to(device) for s in ("", ".scale", ".min") if w + s in views}
        bias = views.get(f"{part}.bias")
        return stored_linear(tensors, infos[w], None if bias is None else bias.to(device), compute_dtype)

    return ExpertWeights(lin("gate_up"), lin("down"))


class WeightStore:
    """All weights resident (mmap-backed): the baseline every tier policy builds on."""

    def __init__(self, container: Container, compute_dtype: torch.dtype):
        self.c = container
        self.compute_dtype = compute_dtype

    def tensor(self, name: str) -> torch.Tensor:
        if not self.c.has(name):
            raise ColibriError(f"{self.c.path}: tensor {name} missing from the container")
        return self.c.tensor(name)

    def linear(self, prefix: str, bias: bool) -> QLinear:
        name = f"{prefix}.weight"
        if not self.c.has(name):
            raise ColibriError(f"{self.c.path}: tensor {name} missing from the container")
        tensors = {s: self.tensor(name + s) for s in ("", ".scale", ".min") if self.c.has(name + s)}
        b = self.tensor(f"{prefix}.bias").to(self.compute_dtype) if bias else None
        return stored_linear(tensors, self.c.info(name), b, self.compute_dtype)

    def record_infos(self, record: str) -> dict[str, dict]:
        r = self.c.record(record)
        return {sub: self.c.info(full) for sub, full in r["tensors"].items()}
