"""Expected reuse distance: an online estimate of when a cached expert is next needed.

Belady's optimal eviction drops the expert needed furthest in the future. Decoding visits layers in a
fixed cycle, so an expert of layer l can next be needed when l next runs (`last[l] + L` accesses from
its last access) and, failing that, one cycle per token later. This keeps, per expert, the chance it is
used at its layer's next access (a two-state estimate: the layer's measured reuse rate if the expert was
used at the layer's last access, else the expert's own rate of being picked after a skip) and a slow
long-run rate b; expected next use = last[l] + L + (1 - a) * L / b. The cache-policy lab
(colibri/analysis/cachesim.py, policy "reuse") measures it against Belady on route traces.
"""

from __future__ import annotations

import numpy as np


class ReuseEstimator:
    """`observe(layer, experts, t)` at every access of a layer (t counts accesses over all layers);
    `expected_next((layer, expert))` is the estimated access time of its next use (larger = evict first),
    `expected_next_many(layers, experts)` the same for arrays of keys (the store scores every cached
    expert at each eviction: a Python loop over hundreds of slots cost ~1 ms a miss).

    State per layer row and expert column, grown as layers and expert ids appear."""

    def __init__(self, n_layers: int, rate: float = 0.03, prior: float = 0.1, reuse_rate: float = 0.05):
        self.n_layers, self.rate, self.prior, self.reuse_rate = max(1, n_layers), rate, prior, reuse_rate
        self._row_of = np.zeros(0, dtype=np.int64)  # layer id -> its row (-1: none yet)
        self.last = np.zeros(0)  # [rows] time of the layer's last access
        self.a_reuse = np.zeros(0)  # [rows] P(used | used at the layer's last access)
        self.b = np.zeros((0, 0))  # [rows, E] long-run rate of use per access of its layer (slow EWMA)
        self.a_skip = np.zeros((0, 0))  # [rows, E] P(used | not used at the layer's last access)
        self.prev = np.zeros((0, 0), dtype=bool)  # [rows, E] used at the layer's last access
        self.seen = np.zeros((0, 0), dtype=bool)  # [rows, E] ever used
        # [rows, E] expected next use, kept up to date row by row (the store asks at every eviction)
        self.exp = np.zeros((0, 0))

    def _ensure(self, layer: int, n_experts: int) -> int:
        if layer >= len(self._row_of):
            self._row_of = np.concatenate((self._row_of, np.full(layer + 1 - len(self._row_of), -1)))
        r = int(self._row_of[layer])
        rows, E = self.b.shape
        if r < 0:
            r = rows
            self._row_of[layer] = r
            self.last = np.append(self.last, 0.0)
            self.a_reuse = np.append(self.a_reuse, 0.5)
            rows += 1
        if rows > self.b.shape[0] or n_experts > E:
            E2 = max(E, n_experts)

            def grow(a: np.ndarray, fill) -> np.ndarray:
                out = np.full((rows, E2), fill, dtype=a.dtype)
                out[: a.shape[0], : a.shape[1]] = a
                return out

            self.b, self.a_skip = grow(self.b, self.prior), grow(self.a_skip, self.prior)
            self.prev, self.seen = grow(self.prev, False), grow(self.seen, False)
            self.exp = np.zeros((rows, E2))
            for row in range(rows):
                self._expect(row)
        return r

    def _expect(self, r: int) -> None:
        a = np.where(self.prev[r], self.a_reuse[r], self.a_skip[r])
        self.exp[r] = self.last[r] + self.n_layers + (1 - a) * self.n_layers / np.maximum(self.b[r], 1e-6)

    def observe(self, layer: int, experts, t: int) -> None:
        ids = np.asarray(experts, dtype=np.int64).reshape(-1)
        r = self._ensure(layer, int(ids.max()) + 1 if ids.size else 0)
        used = np.zeros(self.b.shape[1], dtype=bool)
        used[ids] = True
        prev, seen = self.prev[r].copy(), self.seen[r] | used
        self.seen[r] = seen
        u = used.astype(np.float64)
        b = self.b[r]
        b[seen] += self.rate * (u[seen] - b[seen])
        pu = u[prev]  # the last access's experts, ascending: one EWMA step each, in that order
        if pu.size:
            c = self.reuse_rate
            self.a_reuse[r] = (1 - c) ** pu.size * self.a_reuse[r] + c * float(
                ((1 - c) ** np.arange(pu.size - 1, -1, -1) * pu).sum())
        skip = seen & ~prev
        a = self.a_skip[r]
        a[skip] += 3 * self.rate * (u[skip] - a[skip])
        self.prev[r] = used
        self.last[r] = t
        self._expect(r)

    def expected_next(self, key: tuple[int, int]) -> float:
        return float(self.expected_next_many(np.array([key[0]]), np.array([key[1]]))[0])

    def expected_next_many(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        layers, experts = np.asarray(layers, dtype=np.int64), np.asarray(experts, dtype=np.int64)
        rows = np.full(len(layers), -1, dtype=np.int64)
        inside = (layers >= 0) & (layers < len(self._row_of))
        rows[inside] = self._row_of[layers[inside]]
        has = rows >= 0
        known = has & (experts >= 0) & (experts < self.exp.shape[1])
        if known.all():
            return self.exp[rows, experts]
        # a layer or expert not seen yet: the prior's rates (a = b = prior) from its layer's last access, or 0
        L = self.n_layers
        out = np.zeros(len(layers))
        out[has] = self.last[rows[has]]
        out = out + L + (1 - self.prior) * L / max(self.prior, 1e-6)
        out[known] = self.exp[rows[known], experts[known]]
        return out
