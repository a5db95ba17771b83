"""The cache-policy lab: replay a route trace against expert caches (`colibri routes --simulate`).

Each access is the set of experts one layer needs at once: a token's top-k (`unit="token"`, what a
single decoding stream reads) or a step's union over its rows (`unit="step"`, what the engine read).
Hits are counted per expert. Caches:
- per-layer: every MoE layer owns `size` slots;
- global pool: `size x layers` slots shared by all layers, accessed layer after layer as a forward does.

Policies (victims are never taken from the set being served while anything else can go):
- lru, lfu (perfect LFU: counts over the whole past, ties by recency), lfru (frequency decayed with a
  half-life of `half_life` accesses of the cache: between LFU and LRU; the LRFU family);
- fair: the store's former default (colibri/store/cache.py): each layer an equal share of the pool, LRU inside,
  a layer below its share takes the LRU expert of the layer furthest above it (per-layer: plain LRU);
- fair-lfru: the same shares, lfru inside each layer;
- hot: the learned hot set: each layer's `size - k` most routed experts (counted on `train`, or on the
  trace itself in hindsight) are pinned, the other slots run LRU (fair in the pool);
- reuse: evict the expert with the latest *expected* next use (colibri/store/reuse.py);
- reuse-oracle: reuse told the true experts of the rest of the current token's layers (pool only: per
  layer it is reuse), never evicting those: the most any router look-ahead could add (not online);
- horizon-N (asked for: `simulate(horizons=...)`, `colibri routes --horizons`): reuse told every access of the
  next N tokens exactly (not online): a resident needed within them goes last, the furthest first; the others
  by the estimate. How much of the future a policy would need to come near Belady;
- belady: evict the expert needed furthest in the future (optimal; the upper bound).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from ..store.reuse import ReuseEstimator
from .trace import RouteTrace

POLICIES = ("lru", "lfu", "lfru", "fair", "fair-lfru", "hot", "reuse", "reuse-oracle", "belady")
INF = float("inf")


def access_sets(tr: RouteTrace, unit: str = "token") -> list[list[tuple[int, int]]]:
    """Per access, in time order: [(layer, (experts...))] for every MoE layer, first layer first."""
    layers = tr.layers
    if unit == "token":
        cols = [tr.ids[lay] for lay in layers]
        return [[(lay, tuple(sorted(set(c[i].tolist())))) for lay, c in zip(layers, cols)]
                for i in range(tr.n_rows)]
    if unit != "step":
        raise ValueError(f"unknown unit {unit!r} (token | step)")
    out = []
    bounds = np.flatnonzero(np.diff(tr.step)) + 1
    for rows in np.split(np.arange(tr.n_rows), bounds):
        out.append([(lay, tuple(np.unique(tr.ids[lay][rows]).tolist())) for lay in layers])
    return out


class _Scored:
    """A cache whose victim is the lowest-scored resident key (scores fixed between accesses; a heap
    with stale entries skipped). Pinned keys are read on first use (a miss) and never evicted."""

    def __init__(self, capacity: float, pinned: Iterable = ()):
        self.pinned = set(pinned)
        self.pins_loaded: set = set()
        self.capacity = capacity - len(self.pinned)
        self.score: dict = {}
        self.heap: list = []

    def __len__(self) -> int:
        return len(self.score)

    def _set(self, key, s) -> None:
        self.score[key] = s
        heapq.heappush(self.heap, (s, key))

    def lookup(self, key, t: int) -> bool:
        """A hit (and its bookkeeping), or False."""
        if key in self.pinned:
            hit = key in self.pins_loaded
            self.pins_loaded.add(key)
            return hit
        if key in self.score:
            self._set(key, self.on_hit(key, t))
            return True
        return False

    def insert(self, key, t: int) -> None:
        self._set(key, self.on_miss(key, t))

    def serve(self, keys: tuple, t: int) -> int:
        misses = [key for key in keys if not self.lookup(key, t)]
        need = set(keys)
        for key in misses:
            if key in self.pinned or self.capacity <= 0:
                continue  # pinned: loaded by lookup; no room at all: read and dropped
            if len(self.score) >= self.capacity:
                self.evict(need)
            self.insert(key, t)
        return len(keys) - len(misses)

    def evict(self, need: set):
        """Drop the lowest-scored key, avoiding `need` while anything else can go; returns it."""
        aside, out = [], None
        while self.heap:
            s, key = heapq.heappop(self.heap)
            if self.score.get(key) != s:
                continue  # stale
            if key in need:
                aside.append((s, key))  # serving it now: keep it while something else can go
                continue
            out = key
            break
        if out is None and aside:
            out = aside.pop(0)[1]  # everything left is being served: its lowest-scored
        if out is not None:
            del self.score[out]
        for item in aside:
            heapq.heappush(self.heap, item)
        return out

    def on_hit(self, key, t):
        return self.on_miss(key, t)

    def on_miss(self, key, t):
        raise NotImplementedError


class LRU(_Scored):
    def on_miss(self, key, t):
        return t


class LFU(_Scored):
    def __init__(self, capacity: int, pinned: Iterable = ()):
        super().__init__(capacity, pinned)
        self.count: dict = {}

    def on_miss(self, key, t):
        c = self.count[key] = self.count.get(key, 0) + 1
        return (c, t)


class LFRU(_Scored):
    """Score = sum over past uses of 2^-(age / half_life); stored as log2 so it stays fixed over time."""

    def __init__(self, capacity: int, pinned: Iterable = (), half_life: float = 64.0):
        super().__init__(capacity, pinned)
        self.h = half_life
        self.logc: dict = {}  # key -> (log2 of the decayed count at its last use, last use)

    def on_miss(self, key, t):
        prev = self.logc.get(key)
        c = 1.0 if prev is None else 1.0 + 2.0 ** (prev[0] - (t - prev[1]) / self.h)
        self.logc[key] = (math.log2(c), t)
        return math.log2(c) + t / self.h


class Belady(_Scored):
    """Needs the future: `next_use[(t, key)]`, the next access time of key after t (INF if none).

    The victim is the resident needed furthest ahead, the set being served included (its experts were
    used as they came, so their slots may go): classic demand-paging OPT, every read kept (the engine
    reads into a slot, so keeping nothing is no saving)."""

    def __init__(self, capacity: int, next_use: dict, pinned: Iterable = ()):
        super().__init__(capacity, pinned)
        self.next_use = next_use

    def on_miss(self, key, t):
        return -self.next_use.get((t, key), INF)

    def evict(self, need: set):
        return super().evict(set())


class Fair:
    """The store's fair policy over a pool: each layer an equal share; a layer at its share evicts its own
    victim, one below it takes from the layer furthest above its share. Inside a layer: LRU (the
    store) or any scored policy (`inner`)."""

    def __init__(self, capacity: int, layers: list[int], pinned: Iterable = (), inner=None):
        self.pinned = set(pinned)
        self.pins_loaded: set = set()
        self.capacity = capacity - len(self.pinned)
        self.share = self.capacity / max(1, len(layers))
        make = inner or (lambda: LRU(INF))
        self.layer = {lay: make() for lay in layers}
        self.used = 0

    def serve(self, keys: tuple, t: int) -> int:
        misses = []
        for key in keys:
            if key in self.pinned:
                if key not in self.pins_loaded:
                    self.pins_loaded.add(key)
                    misses.append(key)
            elif not self.layer[key[0]].lookup(key, t):
                misses.append(key)
        need = set(keys)
        for key in misses:
            if key in self.pinned or self.capacity <= 0:
                continue
            if self.used >= self.capacity:
                self._evict(key[0], need)
            self.layer[key[0]].insert(key, t)
            self.used += 1
        return len(keys) - len(misses)

    def _evict(self, layer: int, need: set) -> None:
        own = self.layer[layer]
        if len(own) and len(own) >= self.share:
            order = [own]
        else:
            order = [c for c in sorted(self.layer.values(), key=len, reverse=True) if len(c) > self.share]
            order = order or [c for c in self.layer.values() if len(c)]
        for c in order:
            if c.evict(need) is not None:
                self.used -= 1
                return


class Reuse:
    """Expected-reuse-distance eviction (colibri/store/reuse.py): evict the cached expert whose
    estimated next use is furthest ahead; an online stand-in for Belady."""

    def __init__(self, capacity: float, layers: list[int]):
        self.capacity = capacity
        self.est = ReuseEstimator(len(layers))
        self.cached: set = set()

    def __len__(self) -> int:
        return len(self.cached)

    def serve(self, keys: tuple, t: int) -> int:
        if not keys:
            return 0
        used, keep = set(keys), self._soon(keys, t)
        self.est.observe(keys[0][0], [e for _, e in keys], t)
        hits = sum(1 for key in keys if key in self.cached)
        for key in keys:
            if key in self.cached or self.capacity <= 0:
                continue
            if len(self.cached) >= self.capacity:
                victims = ([c for c in self.cached if c not in used and c not in keep]
                           or [c for c in self.cached if c not in used] or list(self.cached))
                self.cached.discard(self._pick(victims, t))
            self.cached.add(key)
        return hits

    def _pick(self, victims: list, t: int):
        far = self.est.expected_next_many([v[0] for v in victims], [v[1] for v in victims])
        return victims[int(np.argmax(far))]  # (the first of equals, as max would)

    def _soon(self, keys: tuple, t: int) -> set:
        """Keys known to be needed soon (kept while anything else can go): none, online."""
        return set()


class ReuseOracle(Reuse):
    """Reuse that knows the accesses of the rest of the current token (the layers after this one) and
    keeps their experts while anything else can go."""

    def __init__(self, capacity: float, layers: list[int], seq: list[tuple[int, tuple]]):
        super().__init__(capacity, layers)
        self.seq, self.after = seq, {lay: len(layers) - 1 - i for i, lay in enumerate(layers)}

    def _soon(self, keys: tuple, t: int) -> set:
        return {(lay, e) for lay, ids in self.seq[t + 1 : t + 1 + self.after[keys[0][0]]] for e in ids}


class Horizon(Reuse):
    """Reuse told every access of the next `window` accesses (N tokens' worth) exactly: a resident used within
    them is kept until its true next use is the furthest; one not used within them goes first, by the estimate."""

    def __init__(self, capacity: float, layers: list[int], seq: list[tuple[int, tuple]], window: int):
        super().__init__(capacity, layers)
        self.window = window
        self.times: dict = defaultdict(list)  # key -> the times it is accessed, ascending
        for t, (layer, ids) in enumerate(seq):
            for e in ids:
                self.times[(layer, e)].append(t)

    def _pick(self, victims: list, t: int):
        far = self.est.expected_next_many([v[0] for v in victims], [v[1] for v in victims])

        def rank(i: int) -> tuple[int, float]:  # (beyond the window, then the estimate; within, the true time)
            ts = self.times[victims[i]]
            j = bisect.bisect_right(ts, t)
            nxt = ts[j] if j < len(ts) else INF
            return (1, float(far[i])) if nxt - t > self.window else (0, nxt)

        return victims[max(range(len(victims)), key=rank)]  # (the first of equals)


def _next_uses(seq: list[tuple[int, tuple]]) -> dict:
    """(t, key) -> the next t' > t at which key is accessed again."""
    nxt: dict = {}
    last: dict = {}
    for t in range(len(seq) - 1, -1, -1):
        layer, ids = seq[t]
        for e in ids:
            key = (layer, e)
            nxt[(t, key)] = last.get(key, INF)
            last[key] = t
    return nxt


def hot_set(counts: dict[int, np.ndarray], layer: int, n: int) -> list[tuple[int, int]]:
    c = counts.get(layer)
    if c is None or n <= 0:
        return []
    order = sorted(range(len(c)), key=lambda e: (-c[e], e))
    return [(layer, e) for e in order[:n] if c[e] > 0]


def make_cache(policy: str, capacity: int, layers: list[int], seq, *, counts=None, top_k: int = 1,
               per_layer_size: int = 0, half_life: float = 64.0):
    if policy == "lru":
        return LRU(capacity)
    if policy == "lfu":
        return LFU(capacity)
    if policy == "lfru":
        return LFRU(capacity, half_life=half_life)
    if policy == "fair":
        return Fair(capacity, layers) if len(layers) > 1 else LRU(capacity)
    if policy == "fair-lfru":
        return Fair(capacity, layers, inner=lambda: LFRU(INF, half_life=half_life)) if len(layers) > 1 \
            else LFRU(capacity, half_life=half_life)
    if policy == "hot":
        pin_n = max(0, per_layer_size - top_k)
        pinned = [k for lay in layers for k in hot_set(counts or {}, lay, pin_n)]
        return Fair(capacity, layers, pinned) if len(layers) > 1 else LRU(capacity, pinned)
    if policy == "reuse":
        return Reuse(capacity, layers)
    if policy == "reuse-oracle":
        return ReuseOracle(capacity, layers, seq)
    if policy == "belady":
        return Belady(capacity, _next_uses(seq))
    if policy.startswith("horizon-") and policy[8:].isdigit():  # (an access per layer of each token)
        return Horizon(capacity, layers, seq, int(policy[8:]) * len(layers))
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")


def replay(cache, seq: list[tuple[int, tuple]]) -> tuple[int, int, dict[int, int]]:
    """Serve every access; returns (hits, lookups, misses per layer)."""
    hits = looks = 0
    misses: dict[int, int] = {}
    for t, (layer, ids) in enumerate(seq):
        keys = tuple((layer, e) for e in ids)
        h = cache.serve(keys, t)
        hits += h
        looks += len(keys)
        misses[layer] = misses.get(layer, 0) + len(keys) - h
    return hits, looks, misses


def simulate(tr: RouteTrace, sizes: list[int], policies: tuple[str, ...] = POLICIES, *, unit: str = "token",
             train: RouteTrace | None = None, half_life: float = 64.0, horizons: Iterable[int] = ()) -> dict:
    """Hit rates and reads per token for every (mode, size, policy). Sizes are per layer; `horizons` adds a
    horizon-N policy each, before belady."""
    extra = tuple(f"horizon-{n}" for n in horizons)
    if extra:
        policies = tuple(p for p in policies if p != "belady") + extra + (("belady",) if "belady" in policies else ())
    sets = access_sets(tr, unit)
    layers, k = tr.layers, tr.top_k
    src = train if train is not None else tr
    counts = {lay: np.bincount(src.ids[lay].ravel(), minlength=tr.experts.get(lay, 0)) for lay in src.layers}
    tokens = max(1, tr.n_rows)
    nbytes = tr.expert_bytes
    out: dict = {"unit": unit, "tokens": tr.n_rows, "accesses": len(sets), "top_k": k,
                 "hot_from": "train trace" if train is not None else "this trace (hindsight)",
                 "per_layer": {}, "pool": {}}
    per_layer_seq = {lay: [(lay, s[i][1]) for s in sets] for i, lay in enumerate(layers)}
    pool_seq = [a for s in sets for a in s]
    for size in sizes:
        row_l, row_p = {}, {}
        for pol in policies:
            hits = looks = 0
            miss_l: dict[int, int] = {}
            for lay in layers:
                seq = per_layer_seq[lay]
                c = make_cache(pol, size, [lay], seq, counts=counts, top_k=k, per_layer_size=size,
                               half_life=half_life)
                h, n, m = replay(c, seq)
                hits, looks = hits + h, looks + n
                miss_l.update(m)
            row_l[pol] = _result(hits, looks, miss_l, tokens, nbytes)
            c = make_cache(pol, size * len(layers), layers, pool_seq, counts=counts, top_k=k, per_layer_size=size,
                           half_life=half_life * len(layers))
            h, n, m = replay(c, pool_seq)
            row_p[pol] = _result(h, n, m, tokens, nbytes)
        out["per_layer"][size], out["pool"][size] = row_l, row_p
    return out


def _result(hits: int, looks: int, misses: dict[int, int], tokens: int, nbytes: dict[int, int]) -> dict:
    r = {"hit_rate": hits / looks if looks else 0.0, "reads_per_token": sum(misses.values()) / tokens}
    if nbytes:
        r["bytes_per_token"] = sum(m * nbytes.get(lay, 0) for lay, m in misses.items()) / tokens
    return r


def lookahead(tr: RouteTrace) -> dict:
    """Per layer, recall of its actual experts by (a) the router look-ahead recorded in the trace and
    (b) the same experts as the previous token of the same request."""
    out = {}
    k = tr.top_k
    seqs = tr.sequences()
    for lay in tr.layers:
        ids = tr.ids[lay]
        prev_hits = prev_n = 0
        for rows in seqs:
            for a, b in zip(rows[:-1], rows[1:]):
                prev_hits += len(set(ids[a].tolist()) & set(ids[b].tolist()))
                prev_n += k
        r: dict = {"same_as_last_token": prev_hits / prev_n if prev_n else None}
        p = tr.pred.get(lay)
        if p is not None:
            have = p[:, 0] >= 0
            hit = sum(len(set(p[i].tolist()) & set(ids[i].tolist())) for i in np.flatnonzero(have))
            r["router_lookahead"] = hit / (k * int(have.sum())) if have.any() else None
        out[lay] = r
    return out


def format_table(sim: dict) -> list[str]:
    """The printed tables: hit rate per policy and size, the gap to Belady, and reads per token."""
    lines = [f"cache simulation: {sim['tokens']} tokens, unit {sim['unit']}, hot set from {sim['hot_from']}"]
    for mode, title in (("per_layer", "per-layer caches (size = slots per layer)"),
                        ("pool", "global pool (size x layers slots)")):
        table = sim[mode]
        if not table:
            continue
        pols = list(next(iter(table.values())))
        lines.append(f"{title}: hit rate % (reads/token{', MiB/token' if _has_bytes(table) else ''})")
        lines.append("  size " + "".join(f"{p:>18}" for p in pols))
        for size, row in table.items():
            cells = []
            for p in pols:
                r = row[p]
                extra = f"{r['reads_per_token']:.2f}"
                if "bytes_per_token" in r:
                    extra += f", {r['bytes_per_token'] / 2**20:.2f}"
                cells.append(f"{100 * r['hit_rate']:5.1f} ({extra})")
            lines.append(f"  {size:4d} " + "".join(f"{c:>18}" for c in cells))
        if "belady" in pols:
            lines.append("  gap to belady, points: " + "; ".join(
                f"size {size}: " + " ".join(f"{p} {100 * (row['belady']['hit_rate'] - row[p]['hit_rate']):.1f}"
                                            for p in pols if p != "belady") for size, row in table.items()))
    return lines


def _has_bytes(table: dict) -> bool:
    return any("bytes_per_token" in r for row in table.values() for r in row.values())
