"""WeightStore: builds the modules and tensors a model binds to, from a container.

Dense weights are zero-copy views into the container's mapping (float) or fused-kernel
modules over them (int8; int4 repacks once). Routed experts come from an expert source:
resident here; streamed from disk into a bounded cache by the tiered store.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..container import Container
from ..errors import ColibriError
from ..models.moe import ExpertWeights
from ..quant import QLinear


def qlinear_from(tensors: dict[str, torch.Tensor], info: dict, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> QLinear:
    """A QLinear over canonical tensors keyed by suffix ("", ".scale", ".min")."""
    q = info.get("quant")
    if q is None:
        w = tensors[""]
        return QLinear.from_tensors({"": w}, _float_scheme(w.dtype), tuple(w.shape), 0, bias, compute_dtype)
    return QLinear.from_tensors(tensors, q["scheme"], tuple(q["shape"]), q["group_size"], bias, compute_dtype)


def _float_scheme(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]


class ResidentExperts:
    """Every expert of a layer built once and kept (RAM- or GPU-resident layers)."""

    def __init__(self, experts: list[ExpertWeights]):
        self.experts = experts

    def stream(self, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for e in ids:
            yield e, self.experts[e]

    def prefetch(self, ids: list[int]) -> None:
        pass


def expert_weights(views: dict[str, torch.Tensor], infos: dict[str, dict], compute_dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> ExpertWeights:
    """ExpertWeights from a record's member views (sub-name -> tensor)."""
    def lin(part: str) -> QLinear:
        w = f"{part}.weight"
        tensors = {s: views[w + s].to(device) for s in ("", ".scale", ".min") if w + s in views}
        bias = views.get(f"{part}.bias")
        return qlinear_from(tensors, infos[w], None if bias is None else bias.to(device), compute_dtype)

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
        return qlinear_from(tensors, self.c.info(name), b, self.compute_dtype)

    def record_infos(self, record: str) -> dict[str, dict]:
        r = self.c.record(record)
        return {sub: self.c.info(full) for sub, full in r["tensors"].items()}

    def experts(self, prefix: str, module) -> ResidentExperts:
        out = []
        for e in range(module.num_experts):
            rec = f"{prefix}.{e}"
            if not self.c.has_record(rec):
                raise ColibriError(f"{self.c.path}: expert record {rec} missing from the container")
            r = self.c.record(rec)
            views = {sub: self.c.tensor(full) for sub, full in r["tensors"].items()}
            out.append(expert_weights(views, self.record_infos(rec), self.compute_dtype))
        return ResidentExperts(out)
