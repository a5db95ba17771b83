"""The store's expert source: one object that every MoE layer asks for its experts.

`fetch(layer, ids)` hands a layer the experts its rows were routed to (the union over the
step's batch) and `prefetch(layer, ids)` starts reading experts predicted to be needed soon.
Behind it, per layer, either resident weights (RAM or GPU layers: built once, kept) or a share
of an `ExpertCache` (disk layers, or GPU layers over their budget). The MoE layer does not know
which: it only says which experts it needs and combines them in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..models.moe import ExpertWeights
from .cache import ExpertCache


class Experts:
    """Implements models.moe.ExpertSource for every layer of a model (see module doc)."""

    def __init__(self) -> None:
        self.resident: dict[int, list[ExpertWeights]] = {}  # layer -> weights of every expert
        self.cached: dict[int, ExpertCache] = {}  # layer -> the cache holding its experts

    def fetch(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert, weights) for each id, in any order; cache misses are already being read on return."""
        cache = self.cached.get(layer)
        if cache is not None:
            return cache.fetch(layer, ids)
        weights = self.resident[layer]
        return iter([(e, weights[e]) for e in ids])

    def holds_all(self, layer: int) -> bool:
        return layer in self.resident

    def cache_of(self, layer: int) -> ExpertCache | None:
        """The cache serving `layer` (None: a resident layer)."""
        return self.cached.get(layer)

    def prefetch(self, layer: int, ids: list[int], track: bool = True) -> int:
        """Start reading `ids` (ranked, most likely first) of a cached layer; returns reads begun.
        `track`: score this prediction against the layer's next fetch (see ExpertCache.prefetch)."""
        cache = self.cached.get(layer)
        return cache.prefetch(layer, ids, track) if cache is not None else 0
