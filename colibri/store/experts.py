"""The store's expert source: one object that every MoE layer asks for its experts.

`fetch(layer, ids)` hands a layer the experts its rows were routed to (the union over the
step's batch) and `prefetch(layer, ids)` starts reading experts predicted to be needed soon.
Behind it, per layer, either resident weights (RAM or GPU layers: built once, kept) or a share
of an `ExpertCache` (disk layers, or GPU layers over their budget). The MoE layer does not know
which: it only says which experts it needs and combines them in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..kernels import native
from ..layers.moe import ExpertWeights, SwitchGLU, native_expert
from .cache import ExpertCache


class Experts:
    """Implements layers.moe.ExpertSource for every layer of a model (see module doc)."""

    def __init__(self) -> None:
        self.resident: dict[int, list[ExpertWeights]] = {}  # layer -> weights of every expert
        self.cached: dict[int, ExpertCache] = {}  # layer -> the cache holding its experts
        # (layer, residual [T, H]) -> None: reads the next routed layer's predicted experts (store/lookahead.py);
        # set by the store where look-ahead is on and some layer's experts are cached
        self.ahead: Callable[[int, torch.Tensor], None] | None = None
        self._tables: dict[int, native.MoeTables | None] = {}  # layer -> its native tables (built on first use)

    def fetch(self, layer: int, ids: list[int], loaded: bool = True) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) for each id, in any order; cache misses are already being read on return.
        `loaded=False`: a cached layer's experts in memory at the first request are skipped (ExpertCache.fetch)."""
        cache = self.cached.get(layer)
        if cache is not None:
            return cache.fetch(layer, ids, loaded)
        weights = self.resident[layer]
        return iter([(e, weights[e]) for e in ids])

    def holds_all(self, layer: int) -> bool:
        return layer in self.resident

    def look_ahead(self, layer: int, resid: torch.Tensor) -> None:
        if self.ahead is not None:
            self.ahead(layer, resid)

    def native_tables(self, experts: SwitchGLU) -> native.MoeTables | None:
        layer = experts.layer
        if layer not in self._tables:
            self._tables[layer] = None if experts.native_act is None else (
                self._full_tables(experts) if layer in self.resident else self._live_tables(experts))
        return self._tables[layer]

    def _full_tables(self, ex: SwitchGLU) -> native.MoeTables | None:
        ws = list(enumerate(self.resident[ex.layer]))
        if not ws or not all(native_expert(w, ws[0][1].gate_up) for _, w in ws):
            return None
        full = native.MoeTables(ex.num_experts, ex.native_act, ex.input_scaled)
        full.scheme, full.group_size = ws[0][1].gate_up.scheme, ws[0][1].gate_up.group_size
        for e, w in ws:
            full.set(e, w.gate_up, w.down)
        return full

    def _live_tables(self, ex: SwitchGLU) -> native.MoeTables | None:
        """Tables the layer's cache keeps holding exactly the experts in memory (ExpertCache.track)."""
        cache = self.cached.get(ex.layer)
        q = None if cache is None else cache.expert_quant(ex.layer)
        if q is None or q[0] not in ("int8", "int4"):
            return None
        live = native.MoeTables(ex.num_experts, ex.native_act, ex.input_scaled)
        live.scheme, live.group_size, live.live = q[0], q[1], True
        cache.track(ex.layer, live, lambda w: native_expert(w) and (w.gate_up.scheme, w.gate_up.group_size) == q)
        return live

    def forget_tables(self) -> None:
        """Build the native tables again on next use (a caller changed how the layers' experts run)."""
        self._tables.clear()

    def collect_landed(self, layers: list[int]) -> None:
        for cache in {id(c): c for c in (self.cached[i] for i in layers if i in self.cached)}.values():
            cache.collect_landed()

    def prefetch(self, layer: int, ids: list[int], track: bool = True) -> int:
        """Start reading `ids` (ranked, most likely first) of a cached layer; returns reads begun.
        `track`: score this prediction against the layer's next fetch (see ExpertCache.prefetch)."""
        cache = self.cached.get(layer)
        return cache.prefetch(layer, ids, track) if cache is not None else 0
