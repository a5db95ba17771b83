"""ExpertCache unit tests with a fake loader: eviction order, pinning, slot bound, buffer reuse,
prefetch bookkeeping, and that a fetch always delivers every requested expert exactly once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from colibri.layers.moe import ExpertWeights
from colibri.store.cache import ExpertCache

SLOT = 4096


class FakeLoader:
    """Writes (layer, expert) into the slot and returns weights that remember which slot they use."""

    def __init__(self):
        self.loads: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def nbytes(self, layer: int, expert: int) -> int:
        return 1000

    def load(self, layer: int, expert: int, buf: torch.Tensor) -> ExpertWeights:
        with self.lock:
            self.loads.append((layer, expert))
        buf[:2] = torch.tensor([layer, expert], dtype=torch.uint8)
        return ExpertWeights(gate_up=buf, down=None)


def drain(cache: ExpertCache, layer: int, ids: list[int]) -> list[int]:
    """Consume a fetch like SwitchGLU does, checking each delivered slot holds what it claims."""
    got = []
    for e, w in cache.fetch(layer, ids):
        assert w.gate_up[:2].tolist() == [layer, e]
        got.append(e)
    return got


def make(n_slots: int, layers=(0,), policy="lru", pool=None) -> tuple[ExpertCache, FakeLoader]:
    loader = FakeLoader()
    submit = pool.submit if pool is not None else None
    return ExpertCache(loader, n_slots, SLOT, list(layers), submit=submit, policy=policy), loader


def test_lru_order_and_hits():
    cache, loader = make(3)
    drain(cache, 0, [0, 1, 2])
    drain(cache, 0, [0])  # 0 becomes most recent: 1 is now the oldest
    drain(cache, 0, [3])
    assert cache.cached(0) == [2, 0, 3]  # 1 evicted, LRU order oldest first
    drain(cache, 0, [1])
    assert cache.cached(0) == [0, 3, 1]
    s = cache.stats()
    assert (s["hits"], s["misses"], s["evictions"]) == (1, 5, 2)
    assert loader.loads == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 1)]


def test_pinned_experts_are_never_evicted():
    cache, loader = make(3)
    cache.pin(0, [7])
    for e in range(10):
        drain(cache, 0, [e, e + 1])
    assert 7 in cache.cached(0)
    assert loader.loads.count((0, 7)) == 1  # loaded once by pin(), then always a hit
    assert cache.stats()["pinned"] == 1
    with pytest.raises(ValueError, match="unpinned"):
        cache.pin(0, [8, 9])  # would leave no slot to stream through


@pytest.mark.parametrize("policy", ["lru", "fair", "reuse"])
def test_slots_bounded_and_buffers_reused(policy):
    cache, _ = make(4, layers=range(3), policy=policy)
    ptrs = {s.buf.data_ptr() for s in cache.slots}
    arena = (cache.arena.data_ptr(), cache.arena.numel())
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        layer = int(torch.randint(0, 3, (1,), generator=g))
        ids = torch.randperm(16, generator=g)[:3].tolist()
        assert sorted(drain(cache, layer, ids)) == sorted(ids)
        assert len(cache.table) <= cache.n_slots
        assert cache.used_slots <= cache.n_slots
        # every expert held sits in one of the original slots: memory is reused, never grown
        assert {s.buf.data_ptr() for s in cache.table.values()} <= ptrs
    assert (cache.arena.data_ptr(), cache.arena.numel()) == arena
    assert cache.capacity_bytes == 4 * SLOT


def test_one_slot_streams_any_request():
    """Down to a single slot: a request for k experts still completes (each reused in turn)."""
    with ThreadPoolExecutor(2) as pool:
        cache, loader = make(1, pool=pool)
        assert sorted(drain(cache, 0, [5, 1, 3])) == [1, 3, 5]
        assert sorted(drain(cache, 0, [3, 2])) == [2, 3]
        assert cache.used_slots == 1


def test_fair_policy_keeps_each_layers_share():
    """Cyclic layer access (decode) with room for half a token's experts: plain LRU always
    evicts what the next layer needs; the fair share keeps half of every layer's experts."""
    hits = {}
    for policy in ("lru", "fair", "reuse"):
        cache, _ = make(8, layers=range(4), policy=policy)
        for _ in range(20):
            for layer in range(4):
                drain(cache, layer, [0, 1, 2, 3])
        hits[policy] = cache.stats()["hit_rate"]
    assert hits["lru"] == 0.0
    assert hits["fair"] > 0.4
    # reuse ranks by expected next use; every expert of every layer coming back each token is its worst
    # case (it drifts towards the most recent layers) yet it still keeps some. On real route traces it
    # beats fair (tools/policy_gaps.py, docs/ROUTING.md).
    assert hits["reuse"] > 0.2


def test_reuse_policy_keeps_what_comes_back():
    """Layer 0 asks for expert 7 every token plus a stranger, layer 1 only strangers: the reuse policy
    keeps 7 (its estimated next use is soonest), fair's equal shares let the strangers push it out."""
    hits = {}
    for policy in ("fair", "reuse"):
        cache, loader = make(3, layers=range(2), policy=policy)
        strangers = iter(range(8, 1000))
        for _ in range(100):
            drain(cache, 0, [7, next(strangers)])
            drain(cache, 1, [next(strangers)])
        hits[policy] = loader.loads.count((0, 7))
    assert hits["reuse"] <= 3 < hits["fair"]


def test_prefetch_never_evicts_claimed_experts():
    cache, _ = make(3, layers=(0, 1))
    assert cache.prefetch(1, [5]) == 1
    # The look-ahead runs after layer 0's fetch has claimed its experts: it may only take the
    # one unclaimed slot (the unused prefetch of expert 5), never 0 or 1.
    fetched = cache.fetch(0, [0, 1])
    assert cache.prefetch(1, [7, 8]) == 1
    got = []
    for e, w in fetched:
        got.append(e)
        assert w.gate_up[:2].tolist() == [0, e]
    assert sorted(got) == [0, 1]
    assert sorted(cache.cached(1)) == [7]
    s = cache.stats()
    assert (s["prefetch_issued"], s["prefetch_wasted"]) == (2, 1)


def test_prefetch_hits_and_prediction_scores():
    cache, loader = make(6, layers=(0, 1))
    cache.prefetch(1, [5, 6])
    cache.prefetch(1, [7])  # the last prediction for a layer is the one scored
    assert sorted(drain(cache, 1, [5, 7])) == [5, 7]
    s = cache.stats()
    assert (s["hits"], s["misses"], s["prefetch_used"]) == (2, 0, 2)
    assert (s["pred_hits"], s["pred_total"], s["actual_total"]) == (1, 1, 2)
    assert (s["prefetch_precision"], s["prefetch_recall"]) == (1.0, 0.5)
    assert loader.loads == [(1, 5), (1, 6), (1, 7)]


def test_fetch_releases_claims_when_abandoned():
    cache, _ = make(2)
    it = cache.fetch(0, [0, 1])
    next(it)
    it.close()  # consumer stopped early (an exception in the layer, say)
    assert all(s.users == 0 for s in cache.slots)
    assert sorted(drain(cache, 0, [2, 3])) == [2, 3]


def test_failed_load_frees_the_slot():
    class Failing(FakeLoader):
        def load(self, layer, expert, buf):
            if expert == 13:
                raise OSError("disk on fire")
            return super().load(layer, expert, buf)

    cache = ExpertCache(Failing(), 2, SLOT, [0])
    with pytest.raises(OSError, match="fire"):
        drain(cache, 0, [13])
    assert 13 not in cache.cached(0)
    assert sorted(drain(cache, 0, [1, 2])) == [1, 2]


def test_prefetch_stops_reading_ranks_that_mispredict():
    cache, loader = make(8, layers=(0, 1))
    cache.min_precision = 0.75
    for _ in range(40):  # rank 0 always right, rank 1 always wrong
        cache.prefetch(1, [1, 7])
        drain(cache, 1, [1, 2])
    assert cache.rank_ok(0) and not cache.rank_ok(1)
    loads = len(loader.loads)
    cache.prefetch(1, [3, 6])  # only rank 0 (expert 3) is read ahead now
    assert loader.loads[loads:] == [(1, 3)]
    s = cache.stats()
    assert s["pred_total"] == 80 and s["pred_hits"] == 40  # every prediction is still scored


def test_prefetch_only_takes_the_readers_idle_places():
    """With io_depth, speculative reads never queue behind demand reads the reader is still busy with."""
    gate = threading.Event()

    class Slow(FakeLoader):
        def load(self, layer, expert, buf):
            gate.wait(10)
            return super().load(layer, expert, buf)

    loader = Slow()
    with ThreadPoolExecutor(4) as pool:
        cache = ExpertCache(loader, 16, SLOT, [0, 1], submit=pool.submit, policy="reuse", io_depth=4)
        fetched = cache.fetch(0, [0, 1, 2])  # three demand reads in flight of the reader's four
        assert cache.prefetch(1, [5, 6, 7], track=False) == 1
        assert cache.prefetch(1, [8], track=False) == 0  # the reader is full
        gate.set()
        assert sorted(e for e, _ in fetched) == [0, 1, 2]
        for f in [s.future for s in cache.slots if s.future is not None]:
            f.result()
        assert cache.prefetch(1, [8, 9, 10, 11, 12], track=False) == 4  # idle again: up to its depth
    # Without a bound (io_depth 0, the default), the same prefetch is capped only by the layer's share.
    cache, _ = make(16, layers=(0, 1), policy="reuse")
    assert cache.prefetch(1, [5, 6, 7, 8, 9, 10], track=False) == 6


def test_reuse_estimate_by_hand():
    """colibri/store/reuse.py's formulas on two accesses, worked by hand (rates made large to see them)."""
    import numpy as np

    from colibri.store.reuse import ReuseEstimator

    est = ReuseEstimator(2, rate=0.2, prior=0.1, reuse_rate=0.5)
    est.observe(0, [1], 0)  # b[1] = 0.1 + 0.2 * 0.9 = 0.28; a_skip[1] = 0.1 + 0.6 * 0.9 = 0.64
    est.observe(0, [2], 2)  # b[1] -> 0.224, b[2] = 0.28; a_reuse 0.5 -> 0.25 (1 was not reused); a_skip[2] = 0.64
    # expected next = last + L + (1 - a) * L / b, a = a_reuse if used at the last access else a_skip
    want = {(0, 2): 2 + 2 + 0.75 * 2 / 0.28, (0, 1): 2 + 2 + 0.36 * 2 / 0.224,
            (0, 5): 2 + 2 + 0.9 * 2 / 0.1, (1, 0): 0 + 2 + 0.9 * 2 / 0.1}  # an unseen expert, an unseen layer
    for key, v in want.items():
        assert est.expected_next(key) == pytest.approx(v, rel=1e-12), key
    keys = list(want)
    many = est.expected_next_many(np.array([k[0] for k in keys]), np.array([k[1] for k in keys]))
    assert many.tolist() == [est.expected_next(k) for k in keys]


def _random_accesses(seed: int, n: int):
    """(layer, experts) fetches over 6 of 18 layers and up to 70 expert ids, repeats allowed (the tables grow)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for _ in range(n):
        E = int(rng.choice([8, 40, 70]))
        yield int(rng.integers(0, 6)) * 3, [int(x) for x in rng.choice(E, int(rng.integers(1, 17)))]


def test_reuse_estimate_kernel_and_numpy_agree_bit_for_bit():
    """kernels/reuse.c's update is the numpy one's arithmetic, op for op: every state array equal after a few
    thousand fetches, with rows and columns grown by fetches and by scores of keys not seen yet."""
    import numpy as np

    from colibri.store.reuse import ReuseEstimator

    fast = ReuseEstimator(6, rate=0.1, reuse_rate=0.2)
    if fast.c is None:
        pytest.skip("the native kernels are not built here")
    slow = ReuseEstimator(6, rate=0.1, reuse_rate=0.2, native=False)
    for t, (layer, ids) in enumerate(_random_accesses(3, 4000)):
        fast.observe(layer, ids, t)
        slow.observe(layer, ids, t)
        if t % 7 == 0:
            key = (t // 7 % 20, t * 13 % 90)  # (new layers and expert ids too)
            assert fast.score(*key) == slow.score(*key)
    assert fast.exp.shape == (20, 90)
    for name in ("b", "a_skip", "prev", "seen", "exp", "a_reuse", "last"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name


@pytest.mark.parametrize("native,head", [(True, 16), (False, 16), (True, 1)])
def test_reuse_victims_follow_the_estimate(native, head, monkeypatch):
    """The reuse policy keeps each resident's expected next use current (scored as its read starts, rescored as
    its layer is fetched) rather than asking the estimator for all of them at each eviction: at every step the
    kept scores equal the estimator's own, and the evictions equal those of the other implementation (kernel or
    numpy) on the same accesses, also when the kernel's head of the order is one slot (then numpy's order past
    it decides whenever that slot is claimed)."""
    import numpy as np

    from colibri.store import cache as cache_module
    from colibri.store.reuse import ReuseEstimator

    monkeypatch.setattr(cache_module, "ORDER_HEAD", head)

    def reference(cache, layer, anywhere=False):  # every resident scored by the estimator, the whole order
        occ = np.flatnonzero(cache._key_layer >= 0)
        far = cache._reuse.expected_next_many(cache._key_layer[occ], cache._key_expert[occ])
        for i in occ[np.lexsort((cache._tick[occ], cache._key_lpos[occ], -far))]:
            s = cache.slots[i]
            if s.evictable():
                return s
            if not anywhere and s.key[0] == layer and s.future is None:
                return None
        return None

    logs, checked = [], [0]
    for c_path in (native, not native):
        cache, loader = make(40, layers=range(0, 18, 3), policy="reuse")
        if not c_path:
            cache._reuse = ReuseEstimator(6, native=False)
        elif cache._reuse.c is None:
            pytest.skip("the native kernels are not built here")

        def victim(layer, anywhere=False, cache=cache, fast=cache._victim):
            want = reference(cache, layer, anywhere)
            got = fast(layer, anywhere)
            assert got is want
            checked[0] += got is not None
            return got

        cache._victim = victim
        for t, (layer, ids) in enumerate(_random_accesses(5, 600)):
            drain(cache, layer, list(dict.fromkeys(ids)))
            cache.prefetch((layer + 3) % 18, [(e * 7 + t) % 70 for e in ids[:3]])
            occ = np.flatnonzero(cache._key_layer >= 0)
            want = cache._reuse.expected_next_many(cache._key_layer[occ], cache._key_expert[occ])
            assert np.array_equal(cache._far[occ], want)
            assert (cache._far[cache._key_layer < 0] == -np.inf).all()
        logs.append(loader.loads)
    assert len(logs[0]) > 600 and logs[0] == logs[1] and checked[0] > 1000


def test_reuse_estimate_wider_than_the_kernel_stays_on_numpy():
    """A layer with more expert ids than kernels/reuse.c holds (MAX_EXPERTS) is estimated by numpy, the same
    formulas: the expert just used is expected back sooner than one never seen."""
    from colibri.kernels.native_reuse import MAX_EXPERTS
    from colibri.store.reuse import ReuseEstimator

    est = ReuseEstimator(2)
    est.observe(0, [MAX_EXPERTS + 3], 0)
    est.observe(0, [MAX_EXPERTS + 3, 1], 2)
    assert est.exp.shape[1] == MAX_EXPERTS + 4
    assert est.expected_next((0, MAX_EXPERTS + 3)) < est.expected_next((0, 7))


def test_fetch_without_the_loaded_experts():
    """`fetch(..., loaded=False)` (the native step's hook: the kernel computes the experts in memory from the
    layer's table first) yields only what was not in memory, as it lands; the others' claims end at the first
    request, so a read may evict them then, not before."""
    cache, loader = make(3)
    drain(cache, 0, [0, 1])
    it = cache.fetch(0, [0, 1, 2], loaded=False)  # 2 is read into the free slot
    assert [s.users for s in cache.slots] == [1, 1, 1]
    got = [e for e, _ in it]
    assert got == [2] and [s.users for s in cache.slots] == [0, 0, 0]
    it = cache.fetch(0, [0, 1, 2, 3], loaded=False)  # 3 must wait: every slot holds a claimed hit
    assert [s.users for s in cache.slots] == [1, 1, 1] and loader.loads[-1] == (0, 2)
    assert [e for e, _ in it] == [3] and loader.loads[-1] == (0, 3)
    assert sorted(cache.cached(0)) == [1, 2, 3]  # (0, the least recently used, made room)
