"""Which tier each layer lives in: the Placement the planner (colibri/plan.py) or the tier flags
(--gpu/--ram/--disk-layers) give the store."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ColibriError

TIERS = ("gpu", "ram", "disk")


@dataclass
class Placement:
    """Per-layer tiers plus the byte budgets that bound the expert caches.

    Layers are assigned in order: the first `gpu` layers to the GPU, then `ram`, then `disk`
    (layer order). `mem_budget` / `gpu_budget` (bytes) bound the routed-expert
    caches; None means "no cache limit" (everything of that tier resident).
    """

    tiers: list[str]
    mem_budget: int | None = None
    gpu_budget: int | None = None
    pinned: dict[int, list[int]] = field(default_factory=dict)  # layer -> hot experts to keep

    def layers(self, tier: str) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    def describe(self) -> str:
        counts = {t: self.tiers.count(t) for t in TIERS}
        return ", ".join(f"{counts[t]} {t}" for t in TIERS if counts[t]) + " layers"


def from_flags(n_layers: int, gpu: int | None, ram: int | None, disk: int | None,
               cuda_available: bool) -> Placement | None:
    """Validate the three layer counts; None when none was given (the planner decides).

    Counts left out take the remainder (disk first, then ram), so `--gpu-layers 4` alone
    means "4 on the GPU, the rest in RAM". All three given must add up to the layer count.
    """
    if gpu is None and ram is None and disk is None:
        return None
    for name, v in (("--gpu-layers", gpu), ("--ram-layers", ram), ("--disk-layers", disk)):
        if v is not None and v < 0:
            raise ColibriError(f"{name} must be >= 0, got {v}")
    given = sum(v or 0 for v in (gpu, ram, disk))
    if given > n_layers:
        raise ColibriError(f"--gpu-layers + --ram-layers + --disk-layers = {given}, "
                           f"but the model has only {n_layers} layers")
    if None not in (gpu, ram, disk) and given != n_layers:
        raise ColibriError(f"--gpu-layers {gpu} + --ram-layers {ram} + --disk-layers {disk} = {given}, "
                           f"but the model has {n_layers} layers: the three must add up")
    gpu = gpu or 0
    if gpu and not cuda_available:
        raise ColibriError(f"--gpu-layers {gpu} needs a CUDA GPU, and torch sees none "
                           "(use --ram-layers/--disk-layers, or install a CUDA build of torch)")
    if ram is None:
        ram = n_layers - gpu - (disk or 0)
    disk = n_layers - gpu - ram
    return Placement(["gpu"] * gpu + ["ram"] * ram + ["disk"] * disk)


def parse_size(text: str) -> int:
    """'3G', '1500M', '512K', '1073741824' -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(s[-1:], 1)
    try:
        value = float(s[:-1] if s[-1:] in "KMGT" else s)
    except ValueError:
        raise ColibriError(f"bad size '{text}' (examples: 3G, 1500M, 512K)") from None
    if not math.isfinite(value * mult) or value * mult >= 2**63:
        raise ColibriError(f"bad size '{text}': must be a finite number of bytes")
    if value < 0:
        raise ColibriError(f"bad size '{text}': must not be negative")
    return int(value * mult)
