"""Expected reuse distance: an online estimate of when a cached expert is next needed.

Belady's optimal eviction drops the expert needed furthest in the future. Decoding visits layers in a
fixed cycle, so an expert of layer l can next be needed when l next runs (`last[l] + L` accesses from
its last access) and, failing that, one cycle per token later. This keeps, per expert, the chance it is
used at its layer's next access (a two-state estimate: the layer's measured reuse rate if the expert was
used at the layer's last access, else the expert's own rate of being picked after a skip) and a slow
long-run rate b; expected next use = last[l] + L + (1 - a) * L / b. The cache-policy lab
(colibri/cachesim.py, policy "reuse") measures it against Belady on route traces.
"""

from __future__ import annotations


class ReuseEstimator:
    """`observe(layer, experts, t)` at every access of a layer (t counts accesses over all layers);
    `expected_next((layer, expert))` is the estimated access time of its next use (larger = evict first)."""

    def __init__(self, n_layers: int, rate: float = 0.03, prior: float = 0.1, reuse_rate: float = 0.05):
        self.n_layers, self.rate, self.prior, self.reuse_rate = max(1, n_layers), rate, prior, reuse_rate
        self.last: dict[int, int] = {}  # layer -> time of its last access
        self.prev: dict[int, set[int]] = {}  # layer -> experts used at that access
        self.seen: dict[int, set[int]] = {}  # layer -> every expert seen in it
        self.b: dict[tuple[int, int], float] = {}  # long-run rate of use per access of its layer (slow EWMA)
        self.a_skip: dict[tuple[int, int], float] = {}  # P(used | not used at the layer's last access)
        self.a_reuse: dict[int, float] = {}  # per layer: P(used | used at the last access)

    def observe(self, layer: int, experts, t: int) -> None:
        used = set(experts)
        prev, seen = self.prev.get(layer, set()), self.seen.setdefault(layer, set())
        seen |= used
        fast, p0 = 3 * self.rate, self.prior
        for e in seen:
            key, u = (layer, e), 1.0 if e in used else 0.0
            self.b[key] = self.b.get(key, p0) + self.rate * (u - self.b.get(key, p0))
            if e in prev:
                r = self.a_reuse.get(layer, 0.5)
                self.a_reuse[layer] = r + self.reuse_rate * (u - r)
            else:
                self.a_skip[key] = self.a_skip.get(key, p0) + fast * (u - self.a_skip.get(key, p0))
        self.prev[layer] = used
        self.last[layer] = t

    def expected_next(self, key: tuple[int, int]) -> float:
        layer, e = key
        b = max(self.b.get(key, self.prior), 1e-6)
        a = self.a_reuse.get(layer, 0.5) if e in self.prev.get(layer, ()) else self.a_skip.get(key, self.prior)
        return self.last.get(layer, 0) + self.n_layers + (1 - a) * self.n_layers / b
