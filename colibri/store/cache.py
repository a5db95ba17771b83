"""The expert cache: a fixed set of engine-owned slots holding routed experts read from disk.

`fetch(layer, ids)` serves one MoE layer of a step (the batch's union of experts) and
`prefetch(layer, ids)` starts reads ahead (store/lookahead.py decides what). A slot is one
region of a preallocated arena (CPU: anonymous page-aligned memory; or a
device tensor) big enough for any expert record. Slots are filled by a loader running on
the reader's thread pool (pread into the slot, then QLinear modules built over the slot's
bytes) and reused in place on eviction, so the memory held never exceeds the arena plus
the loader's per-slot extras (e.g. the int4 repack), however long the run.

Bookkeeping runs on the calling (compute) thread only; the pool just fills slots, so there
are no locks: a slot being filled has a `future`, and nothing touches it until it is done.

Eviction policy:
- "fair": each cached layer owns an equal share of the unpinned slots and evicts
  its own least recently used expert once at its share; a layer below its share takes the
  LRU expert of the layer furthest above it. Plain LRU is pathological for the layer-cyclic
  access of decoding (layer 0..L-1, then again): with less room than one token's working
  set, it always evicts exactly the layers needed next.
- "lru": one least-recently-used order across all layers.
- "reuse" (TieredStore's default): the evictable expert whose expected next use is furthest
  ahead (colibri/store/reuse.py): an online stand-in for Belady that moves slots to the layers
  whose experts come back; measured against the others in the cache-policy lab (docs/ROUTING.md).
Pinned experts (hot experts named by the placement) are loaded once and never evicted.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
import torch

from ..arena import aligned_buffer
from ..layers.moe import ExpertWeights
from .reuse import ReuseEstimator

POLICIES = ("fair", "lru", "reuse")
RANK_WARMUP = 32  # predictions of a rank scored before its precision may switch its prefetches off
ORDER_HEAD = 16  # victims ranked at once by kernels/reuse.c (the rest, in the rare case, by numpy)


class ExpertLoader(Protocol):
    def nbytes(self, layer: int, expert: int) -> int:
        """Bytes read from disk to load this expert."""
        ...

    def load(self, layer: int, expert: int, buf: torch.Tensor) -> ExpertWeights:
        """Read the expert into `buf` (the slot's memory) and return modules over it (runs on a pool thread)."""
        ...


class AheadQueue(Protocol):
    """A reader whose reads ahead wait behind the reads a step waits for (store/reader.py, store/iopool.py)."""

    def submit_ahead(self, fn: Callable[..., Any], *args: Any) -> Future: ...

    def promote(self, f: Future) -> None: ...

    def waiting_ahead(self) -> int: ...


class _Slot:
    __slots__ = ("index", "buf", "key", "weights", "future", "users", "pinned", "prefetched")

    def __init__(self, index: int, buf: torch.Tensor):
        self.index, self.buf = index, buf
        self.key: tuple[int, int] | None = None
        self.weights: ExpertWeights | None = None
        self.future: Future | None = None  # set while the loader fills the slot
        self.users = 0  # claims by the running fetch: never evicted while > 0
        self.pinned = False
        self.prefetched = False  # filled by a prefetch and not requested since

    def evictable(self) -> bool:
        return self.users == 0 and (self.future is None or self.future.done())


def _run_now(fn: Callable, *args) -> Future:
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - delivered through the future, like a pool would
        f.set_exception(e)
    return f


class ExpertCache:
    """Routed experts of several layers under a fixed number of slots.

    `n_slots` slots of `slot_bytes` bytes each live in one arena on `device`; `extra_bytes`
    is what the loader allocates per loaded expert beyond the slot (counted in `capacity_bytes`
    so that budgets stay honest). `submit(fn, *args) -> Future` runs loads (default: inline).
    `layers` lists the layers served (for the fair share). `ahead`: the reader, when its reads ahead
    queue behind the reads a step waits for (AheadQueue).
    """

    def __init__(self, loader: ExpertLoader, n_slots: int, slot_bytes: int, layers: list[int], *,
                 submit: Callable[..., Future] | None = None, device: torch.device | str = "cpu",
                 policy: str = "fair", extra_bytes: int = 0, min_precision: float = 0.0, io_depth: int = 0,
                 ahead: AheadQueue | None = None):
        if n_slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {n_slots}")
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; expected one of {POLICIES}")
        self.loader, self.n_slots, self.slot_bytes = loader, n_slots, slot_bytes
        self.extra_bytes, self.policy, self.device = extra_bytes, policy, torch.device(device)
        self.layers = list(layers)
        self.submit = submit or _run_now
        # Reads the reader runs at once (0: unbounded). A batch's or a prompt's predicted union only takes the
        # reader's idle places: its many wrong reads cost the disk and the cache (8 streams from disk: 19.6 ->
        # 14.7 MiB read per token, benchmarks/bench_batch.py). With a reader whose reads ahead wait behind a
        # step's (`ahead`), one token's ranked guesses (precise by the rank gate) may queue, up to io_depth of
        # them: more of the disk time hidden (docs/BENCHMARKS.md "Streamed decode at the disk's limit").
        self.io_depth = io_depth
        self._ahead = ahead
        self._inflight: set[_Slot] = set()  # slots whose read may still be running (pruned by _loading)
        if self.device.type == "cpu":
            self.arena = aligned_buffer(n_slots * slot_bytes)
        else:
            self.arena = torch.empty(n_slots * slot_bytes, dtype=torch.uint8, device=self.device)
        self.slots = [_Slot(i, self.arena[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(n_slots)]
        # Popped from the end: the lowest slots are used first (and reused first once freed).
        self.free: list[_Slot] = self.slots[::-1]
        self.table: dict[tuple[int, int], _Slot] = {}
        self.lru: dict[int, OrderedDict[int, _Slot]] = {layer: OrderedDict() for layer in self.layers}
        self.n_pinned = 0
        self._clock, self._tick = 0, np.zeros(n_slots, dtype=np.int64)  # last-use time per slot
        # Per slot, the (layer, expert) of an unpinned resident (-1: none) and its layer's position: the
        # reuse policy scores all of them at once at each eviction.
        self._key_layer = np.full(n_slots, -1, dtype=np.int64)
        self._key_expert = np.full(n_slots, -1, dtype=np.int64)
        self._key_lpos = np.zeros(n_slots, dtype=np.int64)
        # Per slot, the reuse policy's expected next use of its unpinned resident (-inf: none), kept current: a
        # read started scores its key, a fetch rescores its layer's slots (only that layer's estimate moved).
        self._far = np.full(n_slots, -np.inf)
        self._head = np.zeros(ORDER_HEAD, dtype=np.int64)  # the victim order's head, as kernels/reuse.c writes it
        # (the addresses kernels/reuse.c reads and writes: far, layer positions, last-use ticks, keys, head)
        self._at = tuple(a.ctypes.data for a in (self._far, self._key_lpos, self._tick, self._key_layer,
                                                 self._key_expert, self._head))
        self._lpos = {layer: i for i, layer in enumerate(self.layers)}
        self._reuse = ReuseEstimator(len(self.layers)) if policy == "reuse" else None
        self._accesses = 0  # fetches so far: the reuse estimator's clock
        self._predicted: dict[int, list[int]] = {}
        # Look-ahead scoring per prediction rank (0 = the router's top choice): [right, made].
        # A rank is prefetched only while its precision is >= min_precision (after a warm-up):
        # a wrong prefetch costs a whole read and evicts a cached expert.
        self.min_precision = min_precision
        self._rank: list[list[int]] = []
        self.counts = dict.fromkeys(
            ("hits", "misses", "evictions", "bytes_read", "reads", "prefetch_issued", "prefetch_used",
             "prefetch_wasted", "prefetch_wasted_bytes", "pred_hits", "pred_total", "actual_total",
             "pin_bytes_read"), 0)
        self.wait_s = 0.0
        # layer -> (native pointer table, which experts it may hold): kept equal to the slots whose
        # weights are in, for a one-call native step over cached layers (engine/native_step.py)
        self._live: dict[int, tuple[Any, Callable[[ExpertWeights], bool]]] = {}

    # ------------------------------------------------------------------ sizes

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * (self.slot_bytes + self.extra_bytes)

    @property
    def used_slots(self) -> int:
        return self.n_slots - len(self.free)

    @property
    def share(self) -> float:
        """Unpinned slots per layer (the fair policy's per-layer quota)."""
        return (self.n_slots - self.n_pinned) / max(1, len(self.layers))

    def cached(self, layer: int) -> list[int]:
        """Experts of `layer` currently held (loaded or loading), least recently used first."""
        pinned = [e for (lay, e), s in self.table.items() if lay == layer and s.pinned]
        return pinned + list(self.lru.get(layer, ()))

    # ------------------------------------------------------------------ slot management

    def _collect(self, s: _Slot) -> ExpertWeights:
        """The slot's weights, waiting for its load if needed (a failed load frees the slot, then raises)."""
        f = s.future
        if f is not None:
            if not f.done():
                if self._ahead is not None:
                    self._ahead.promote(f)  # (a read ahead not started yet: the step waits for it now)
                t0 = time.perf_counter()
                f.exception()  # waits
                self.wait_s += time.perf_counter() - t0
            s.future = None
            err = f.exception()
            if err is not None:
                self._drop(s)
                self.free.append(s)
                raise err
            s.weights = f.result()
            self._publish(s)
        return s.weights

    def _drop(self, s: _Slot) -> None:
        layer, e = s.key
        live = self._live.get(layer)
        if live is not None:
            live[0].clear(e)
        del self.table[s.key]
        self.lru[layer].pop(e, None)
        s.key = s.weights = None
        self._key_layer[s.index] = self._key_expert[s.index] = -1
        self._far[s.index] = -np.inf
        s.prefetched = False

    def _evict(self, s: _Slot) -> None:
        if s.future is not None:  # finished loading (evictable() checked it): collect, ignore errors
            s.future = None
        if s.prefetched:
            self.counts["prefetch_wasted"] += 1
            self.counts["prefetch_wasted_bytes"] += self.loader.nbytes(*s.key)
        self._drop(s)
        self.counts["evictions"] += 1

    def _victim(self, layer: int, anywhere: bool = False) -> _Slot | None:
        """The slot to evict for a load into `layer` (None: nothing may go right now)."""
        if self.policy == "fair" and not anywhere:
            share = self.share
            own = self.lru.get(layer)
            if own is not None and own and len(own) >= share:
                # At our share: only our own LRU expert may go (or we wait for one to be released).
                return next((s for s in own.values() if s.evictable()), None)
            # Below our share: take from the layer furthest above its share.
            for od in sorted(self.lru.values(), key=len, reverse=True):
                if len(od) <= share:
                    break
                s = next((s for s in od.values() if s.evictable()), None)
                if s is not None:
                    return s
            return None
        if self._reuse is not None:
            # The furthest expected next use goes. This layer's own experts count even while claimed: when
            # one of them is the furthest, wait for its release (the fetch streams through it) rather than
            # evict an expert another layer needs sooner.
            for i in self._order():
                s = self.slots[i]
                if s.evictable():
                    return s
                if not anywhere and s.key[0] == layer and s.future is None:
                    return None  # our own claimed expert is the furthest: wait for its release
            return None
        # Global LRU: the oldest evictable slot over all layers (each layer's dict is in LRU order).
        best, best_tick = None, None
        for od in self.lru.values():
            s = next((s for s in od.values() if s.evictable()), None)
            if s is not None and (best_tick is None or self._tick[s.index] < best_tick):
                best, best_tick = s, self._tick[s.index]
        return best

    def _order(self) -> Iterator[int]:
        """The unpinned residents by expected next use, furthest first (ties: layer order, then least recently
        used): the kernel's first ORDER_HEAD (the victim is almost always among them), then numpy's whole order."""
        c = self._reuse.c
        if c is not None:
            got = c.coli_reuse_order(*self._at[:3], self.n_slots, self._at[5], ORDER_HEAD)
            yield from self._head[:got].tolist()
            if got < ORDER_HEAD:
                return
        occ = np.flatnonzero(self._key_layer >= 0)
        order = occ[np.lexsort((self._tick[occ], self._key_lpos[occ], -self._far[occ]))].tolist()
        yield from (order if c is None else order[ORDER_HEAD:])

    def _rescore(self, layer: int) -> None:
        """A fetch of `layer` moved its estimate: its residents' expected next uses again."""
        c = self._reuse.c
        if c is not None:
            row, E = self._reuse.row_address(layer)
            if c.coli_reuse_rescore(self._at[0], self._at[3], self._at[4], self.n_slots, layer, row, E) != 0:
                raise RuntimeError("coli_reuse_rescore: an expert id outside the estimate")
            return
        mine = np.flatnonzero(self._key_layer == layer)
        self._far[mine] = self._reuse.row(layer)[self._key_expert[mine]]

    def _take(self, layer: int, block: bool) -> _Slot | None:
        """A slot to load into: a free one, else an evicted one; with `block`, wait until one can go
        (called so only when the caller holds no claims, so every slot is free, evictable or loading)."""
        if self.free:
            return self.free.pop()
        s = self._victim(layer)
        if s is None and block:
            s = self._victim(layer, anywhere=True)
            if s is None:  # everything unpinned is still loading (prefetches): wait for our own first
                loading = sorted((t for od in self.lru.values() for t in od.values() if t.future is not None),
                                 key=lambda t: t.key[0] != layer)
                if not loading:
                    raise RuntimeError("expert cache: no slot can be freed (all claimed or pinned)")
                t0 = time.perf_counter()
                if self._ahead is not None:
                    self._ahead.promote(loading[0].future)
                loading[0].future.exception()
                self.wait_s += time.perf_counter() - t0
                s = loading[0]
        if s is not None:
            self._evict(s)
        return s

    def _start(self, s: _Slot, layer: int, e: int, prefetched: bool) -> None:
        s.key, s.prefetched = (layer, e), prefetched
        self._key_layer[s.index], self._key_expert[s.index] = layer, e
        self._key_lpos[s.index] = self._lpos.get(layer, len(self._lpos))
        if self._reuse is not None:
            self._far[s.index] = self._reuse.score(layer, e)
        self.table[s.key] = s
        self.lru[layer][e] = s
        self._touch(s)
        self.counts["bytes_read"] += self.loader.nbytes(layer, e)
        self.counts["reads"] += 1
        submit = self._ahead.submit_ahead if prefetched and self._ahead is not None else self.submit
        s.future = submit(self.loader.load, layer, e, s.buf)
        self._inflight.add(s)

    def _touch(self, s: _Slot) -> None:
        self._clock += 1
        self._tick[s.index] = self._clock

    # ------------------------------------------------------------------ public API

    def pin(self, layer: int, experts: list[int]) -> None:
        """Load `experts` of `layer` now and keep them for good (outside the LRU and the shares)."""
        for e in experts:
            if (layer, e) in self.table:
                continue
            if len(self.free) <= 1:
                raise ValueError(f"cannot pin expert {e} of layer {layer}: the cache has {self.n_slots} slots "
                                 "and at least one must stay unpinned")
            s = self.free.pop()
            s.key, s.pinned = (layer, e), True
            self.table[s.key] = s
            s.weights = self.submit(self.loader.load, layer, e, s.buf).result()
            self.counts["pin_bytes_read"] += self.loader.nbytes(layer, e)
            self.n_pinned += 1

    def rank_ok(self, rank: int) -> bool:
        """Whether predictions of this rank are right often enough to be worth a read."""
        if rank >= len(self._rank) or self._rank[rank][1] < RANK_WARMUP:
            return True
        right, made = self._rank[rank]
        return right >= self.min_precision * made

    def prefetch(self, layer: int, ids: list[int], track: bool = True) -> int:
        """Start loading experts of `layer` predicted to be needed soon; returns how many reads began.

        `ids` are ranked (most likely first). With `track` (one token's top-k), the prediction is
        scored against the next `fetch` of the layer and each rank is read only while its
        precision holds; without (a prefill's union), only while the top rank's does. Only free
        or evictable slots are used, at most the layer's share (fair, reuse) or half the cache (lru),
        and no more than the reader has idle (`io_depth` minus the reads in flight), or, with `ahead`
        and `track`, `io_depth` reads waiting behind the step's own.
        """
        if track:
            self._predicted[layer] = list(ids)
        elif not self.rank_ok(0):
            return 0
        cap = max(1, int(self.share)) if self.policy != "lru" else max(1, (self.n_slots - self.n_pinned) // 2)
        if self.io_depth:
            queued = self._ahead.waiting_ahead() if track and self._ahead is not None else self._loading()
            cap = min(cap, self.io_depth - queued)
        started = 0
        for r, e in enumerate(ids):
            if started >= cap:
                break
            if (layer, e) in self.table or (track and not self.rank_ok(r)):
                continue
            s = self._take(layer, block=False)
            if s is None:
                break
            self._start(s, layer, e, prefetched=True)
            started += 1
        self.counts["prefetch_issued"] += started
        return started

    # ------------------------------------------------------------------ a native table per layer

    def _publish(self, s: _Slot) -> None:
        live = self._live.get(s.key[0])
        if live is not None and live[1](s.weights):
            live[0].set(s.key[1], s.weights.gate_up, s.weights.down)

    def expert_quant(self, layer: int) -> tuple[str, int] | None:
        """The scheme and group size of `layer`'s experts, as the loader will build them (None: unknown)."""
        quant = getattr(self.loader, "quant", None)
        return None if quant is None else quant(layer)

    def track(self, layer: int, tables: Any, ok: Callable[[ExpertWeights], bool]) -> None:
        """Keep `tables` (kernels/native.py MoeTables) holding exactly the experts of `layer` whose weights
        are in memory and pass `ok`: set as a read is collected, cleared as its slot is evicted. Valid
        while no fetch runs: what a native step reads between the engine's fetches."""
        self._live[layer] = (tables, ok)
        for (lay, _), s in self.table.items():
            if lay == layer and s.future is None and s.weights is not None:
                self._publish(s)

    def collect_landed(self) -> None:
        """Collect the reads that have landed (prefetches) so that the native tables see them; a failed
        read is left for the fetch that asks for it, which raises."""
        for s in list(self._inflight):
            f = s.future
            if f is not None and f.done() and f.exception() is None:
                self._collect(s)
        self._inflight = {s for s in self._inflight if s.future is not None}  # (what is left to land, or failed)

    def _loading(self) -> int:
        """Reads started and not yet landed."""
        self._inflight = {s for s in self._inflight if s.future is not None and not s.future.done()}
        return len(self._inflight)

    def fetch(self, layer: int, ids: list[int], loaded: bool = True) -> Iterator[tuple[int, ExpertWeights]]:
        """Claim the cached experts among `ids` and start reading the others, now; the iterator
        returned yields (expert, weights) for each id: cached ones first, then misses as their
        reads land. A prefetch issued after this call never evicts what it claimed.

        Each yielded expert stays claimed (unevictable) until the consumer asks for the next;
        closing the iterator early releases every claim. With `loaded=False` the experts already in
        memory at the first request are not yielded: their claims end there (a native step computed
        them from the layer's table before asking: engine/stream_hook.py).
        """
        it = self._fetch(layer, ids, loaded)
        next(it)  # runs up to the claims and the first reads (the generator's first yield)
        return it

    def _fetch(self, layer: int, ids: list[int], loaded: bool = True) -> Iterator[tuple[int, ExpertWeights] | None]:
        c = self.counts
        if self._reuse is not None:
            self._reuse.observe(layer, ids, self._accesses)
            self._accesses += 1
            self._rescore(layer)
        table = self.table
        hits: list[tuple[int, _Slot]] = []
        misses: deque[int] = deque()
        for e in ids:
            s = table.get((layer, e))
            if s is not None and s.users == 0 and s.future is not None and s.future.done() \
                    and s.future.exception() is not None:  # (a read that failed earlier: read it again)
                self._drop(s)
                s.future = None
                self.free.append(s)
                s = None
            if s is None:
                misses.append(e)
                continue
            s.users += 1
            hits.append((e, s))
            if not s.pinned:
                self.lru[layer].move_to_end(e)
                self._touch(s)
                if s.prefetched:
                    s.prefetched = False
                    c["prefetch_used"] += 1
                    if self._ahead is not None and s.future is not None and not s.future.done():
                        self._ahead.promote(s.future)
        c["hits"] += len(hits)
        c["misses"] += len(misses)
        pred = self._predicted.pop(layer, None)
        if pred is not None:
            actual = set(ids)
            while len(self._rank) < len(pred):
                self._rank.append([0, 0])
            for r, e in enumerate(pred):
                right = e in actual
                self._rank[r][0] += right
                self._rank[r][1] += 1
                c["pred_hits"] += right
            c["pred_total"] += len(pred)
            c["actual_total"] += len(ids)
        held = [s for _, s in hits]
        pending: list[tuple[int, _Slot]] = []
        try:
            self._issue(layer, misses, pending, held, block=False)
            yield None  # (fetch returns here: claims made, reads started)
            hits.sort(key=lambda es: es[1].future is not None)  # loaded ones first, then still loading
            if not loaded:
                ready = sum(1 for _, s in hits if s.future is None)
                for _, s in hits[:ready]:
                    s.users -= 1
                    held.remove(s)
                del hits[:ready]
            for e, s in hits:
                w = self._collect(s)
                yield e, w
                s.users -= 1
                held.remove(s)
            while pending or misses:
                if not pending:
                    self._issue(layer, misses, pending, held, block=True)
                j = next((i for i, (_, s) in enumerate(pending) if s.future is None or s.future.done()), 0)
                e, s = pending.pop(j)
                w = self._collect(s)
                yield e, w
                s.users -= 1
                held.remove(s)
                if misses:
                    self._issue(layer, misses, pending, held, block=False)
        finally:
            for s in held:
                s.users -= 1

    def _issue(self, layer: int, misses: deque[int], pending: list, held: list, block: bool) -> None:
        while misses:
            s = self._take(layer, block=block and not pending)
            if s is None:
                return
            e = misses.popleft()
            s.users += 1
            held.append(s)
            self._start(s, layer, e, prefetched=False)
            pending.append((e, s))

    def drain(self) -> None:
        """Wait for every load in flight (before closing the reader)."""
        for s in self.slots:
            if s.future is not None:
                s.future.exception()

    def stats(self) -> dict:
        c = dict(self.counts)
        lookups = c["hits"] + c["misses"]
        c["hit_rate"] = c["hits"] / lookups if lookups else 0.0
        c["prefetch_precision"] = c["pred_hits"] / c["pred_total"] if c["pred_total"] else 0.0
        c["prefetch_recall"] = c["pred_hits"] / c["actual_total"] if c["actual_total"] else 0.0
        c.update(io_wait_s=self.wait_s, slots=self.n_slots, used_slots=self.used_slots, pinned=self.n_pinned,
                 slot_bytes=self.slot_bytes + self.extra_bytes, capacity_bytes=self.capacity_bytes)
        return c
