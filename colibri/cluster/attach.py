"""How an Engine (colibri/api.py) takes a cluster: what the head's own store loads, then the stages or the expert
workers, and one object for its health, counters and shutdown."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..engine.decode_plan import DecodePlan
from ..engine.kv import SlotPool
from ..errors import ColibriError
from ..store.placement import Placement

MODES = ("pipeline", "experts")


def prepare(model: nn.Module, mode: str) -> tuple[Callable[[str], bool] | None, bool, Placement]:
    """Before the head's store loads: its `keep` filter, whether it reads routed experts, its placement. Pipeline:
    the head holds only the embedding, final norm and head; experts: everything but the routed experts."""
    if mode not in MODES:
        raise ColibriError(f"--cluster-mode must be one of {', '.join(MODES)}, got {mode!r}")
    placement = Placement(["ram"] * len(model.model.layers))
    if mode == "experts":
        return None, False, placement
    from .elsewhere import hold

    return hold(model, 0, 0, ends=True), True, placement


def start(engine, mode: str, address: str, n: int | None, budget: int | None, opts: dict, timeout: float | None):
    """After the head's weights are bound: (slots, plan, the cluster part: health, counters, close, n_experts)."""
    if mode == "pipeline":
        from .head import open_cluster

        slots, plan = open_cluster(engine, address, n, budget, opts, timeout)
        return slots, plan, plan
    from .experts import open_experts

    source = open_experts(engine, address, n, budget, timeout)
    try:
        slots = SlotPool(engine.model, opts["slots"], opts["ctx"], engine.dtype, lambda i: torch.device("cpu"),
                         engine.kv_types)
    except BaseException:
        source.close()
        raise
    # the MoE layers call out per layer: the plan's torch backend (attention still on the per-layer kernels)
    return slots, DecodePlan(engine.model, native=False), source
