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

import ctypes

import numpy as np

from ..kernels import native_reuse


class ReuseEstimator:
    """`observe(layer, experts, t)` at every access of a layer (t counts accesses over all layers);
    `expected_next((layer, expert))` is the estimated access time of its next use (larger = evict first),
    `expected_next_many(layers, experts)` the same for arrays of keys (the cache-policy lab's victims);
    `score` and `row` / `row_address` what the store keeps per slot (a key as its read starts, a layer's row
    after its fetch).

    State per layer row and expert column, grown as layers and expert ids appear."""

    def __init__(self, n_layers: int, rate: float = 0.03, prior: float = 0.1, reuse_rate: float = 0.05,
                 native: bool = True):
        self.n_layers, self.rate, self.prior, self.reuse_rate = max(1, n_layers), rate, prior, reuse_rate
        # kernels/reuse.c does observe's arithmetic op for op (the same bits); numpy where the kernels are absent
        self.c = native_reuse.lib() if native else None
        self._at: tuple[int, ...] | None = None  # the state arrays' addresses for it (None: take them again)
        self._row_of = np.zeros(0, dtype=np.int64)  # layer id -> its row (-1: none yet)
        self.last = np.zeros(0)  # [rows] time of the layer's last access
        self.a_reuse = np.zeros(0)  # [rows] P(used | used at the layer's last access)
        self.b = np.zeros((0, 0))  # [rows, E] long-run rate of use per access of its layer (slow EWMA)
        self.a_skip = np.zeros((0, 0))  # [rows, E] P(used | not used at the layer's last access)
        self.prev = np.zeros((0, 0), dtype=bool)  # [rows, E] used at the layer's last access
        self.seen = np.zeros((0, 0), dtype=bool)  # [rows, E] ever used
        # [rows, E] expected next use, kept up to date row by row (the store asks at every eviction)
        self.exp = np.zeros((0, 0))
        self._decays: dict[int, np.ndarray] = {}

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
            self._at = None
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
            self._at = None
            for row in range(rows):
                self._expect(row)
        return r

    def _expect(self, r: int) -> None:
        # exp = (last + L) + (1 - a) * L / max(b, 1e-6), a = a_reuse where used at the last access else a_skip:
        # in place, a few ufunc calls on the row (the store calls this at every fetch)
        out, L = self.exp[r], self.n_layers
        np.subtract(1.0, self.a_skip[r], out=out)
        out[self.prev[r]] = 1 - self.a_reuse[r]
        out *= L
        out /= np.maximum(self.b[r], 1e-6)
        out += self.last[r] + L

    def observe(self, layer: int, experts, t: int) -> None:
        ids = list(experts)
        r = self._ensure(layer, max(ids) + 1 if ids else 0)
        if self.c is not None and self.b.shape[1] <= native_reuse.MAX_EXPERTS:
            at, E = self._addresses(), self.b.shape[1]
            rc = self.c.coli_reuse_observe(at[0] + 8 * r * E, at[1] + 8 * r * E, at[2] + r * E, at[3] + r * E,
                                           at[4] + 8 * r * E, E, (ctypes.c_long * len(ids))(*ids), len(ids),
                                           self.rate, self.reuse_rate, at[5] + 8 * r, at[6] + 8 * r, float(t),
                                           self.n_layers)
            if rc != 0:
                raise RuntimeError(f"coli_reuse_observe failed ({rc})")
            return
        u = np.zeros(self.b.shape[1])  # [E] 1.0 where used now
        u[ids] = 1.0
        used = u > 0
        prev, seen = self.prev[r], self.seen[r]
        seen |= used
        b, d = self.b[r], u - self.b[r]
        d *= self.rate
        np.add(b, d, out=b, where=seen)  # b += rate * (u - b) where seen
        k = int(np.count_nonzero(prev))
        if k:  # the last access's experts, ascending: one EWMA step each, in that order (summed in order)
            c = self.reuse_rate
            self.a_reuse[r] = (1 - c) ** k * self.a_reuse[r] + c * float(np.cumsum(self._decay(k) * u[prev])[-1])
        a, d = self.a_skip[r], u - self.a_skip[r]
        d *= 3 * self.rate
        np.add(a, d, out=a, where=seen & ~prev)  # a_skip moves only where seen and not used last time
        prev[:] = used
        self.last[r] = t
        self._expect(r)

    def _addresses(self) -> tuple[int, ...]:
        if self._at is None:
            self._at = tuple(a.ctypes.data for a in (self.b, self.a_skip, self.prev, self.seen, self.exp,
                                                     self.a_reuse, self.last))
        return self._at

    def _decay(self, k: int) -> np.ndarray:
        """(1 - reuse_rate) ** [k-1, ..., 0]: the weights of k EWMA steps, oldest first (cached per k)."""
        w = self._decays.get(k)
        if w is None:
            # (Python's float power: the C library's pow, as kernels/reuse.c; numpy's may be a SIMD one off by an ulp)
            w = self._decays[k] = np.array([(1 - self.reuse_rate) ** j for j in range(k - 1, -1, -1)])
        return w

    def score(self, layer: int, expert: int) -> float:
        """expected_next((layer, expert)), the key made known first (a new row or column holds the prior's
        state, so its value is the one expected_next gives an unseen key): the store scores each read it starts."""
        return float(self.row(layer, expert + 1)[expert])

    def row(self, layer: int, n_experts: int = 0) -> np.ndarray:
        """[E] the expected next use of `layer`'s experts, kept up to date in place until the table grows."""
        r = self._ensure(layer, n_experts)  # (first: it may replace self.exp)
        return self.exp[r]

    def row_address(self, layer: int) -> tuple[int, int]:
        """(address, E) of `layer`'s row of expected next uses (a layer observed), for kernels/reuse.c: valid
        until the next observe or score."""
        E = self.exp.shape[1]
        return self._addresses()[4] + 8 * E * int(self._row_of[layer]), E

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
