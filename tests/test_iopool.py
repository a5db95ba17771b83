"""The reader's pool (store/iopool.py): a step's reads run before the look-ahead's, a read ahead a step comes to
need is promoted, and the expert cache queues its ranked guesses there without changing what a fetch gives."""

from __future__ import annotations

import threading

import pytest
import torch

from colibri.layers.moe import ExpertWeights
from colibri.store.cache import ExpertCache
from colibri.store.iopool import IOPool


def blocked_pool() -> tuple[IOPool, threading.Event, list[str]]:
    """A one-thread pool held busy by a first job until the event is set; jobs log their names in run order."""
    pool, go, ran = IOPool(1), threading.Event(), []
    pool.submit(go.wait)
    return pool, go, ran


def test_reads_a_step_waits_for_run_before_reads_ahead():
    pool, go, ran = blocked_pool()
    futs = [pool.submit_ahead(ran.append, "ahead 1"), pool.submit_ahead(ran.append, "ahead 2"),
            pool.submit(ran.append, "now 1"), pool.submit(ran.append, "now 2")]
    assert pool.waiting_ahead() == 2
    go.set()
    for f in futs:
        f.result(timeout=10)
    assert ran == ["now 1", "now 2", "ahead 1", "ahead 2"]
    pool.shutdown()


def test_a_promoted_read_ahead_runs_with_the_steps_reads():
    pool, go, ran = blocked_pool()
    a1, a2 = pool.submit_ahead(ran.append, "ahead 1"), pool.submit_ahead(ran.append, "ahead 2")
    n1 = pool.submit(ran.append, "now 1")
    pool.promote(a2)
    pool.promote(n1)  # (not a read ahead: nothing to move)
    assert pool.waiting_ahead() == 1
    go.set()
    for f in (a1, a2, n1):
        f.result(timeout=10)
    assert ran == ["now 1", "ahead 2", "ahead 1"]
    pool.shutdown()


def test_errors_reach_the_waiter_and_shutdown_runs_what_is_queued():
    pool, go, ran = blocked_pool()
    bad = pool.submit(int, "not a number")
    late = pool.submit_ahead(ran.append, "queued before the shutdown")
    go.set()
    pool.shutdown(wait=True)
    with pytest.raises(ValueError):
        bad.result(timeout=10)
    assert late.done() and ran == ["queued before the shutdown"]
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(ran.append, "after")


class Loader:
    def __init__(self):
        self.loads: list[tuple[int, int]] = []

    def nbytes(self, layer: int, expert: int) -> int:
        return 1000

    def load(self, layer: int, expert: int, buf: torch.Tensor) -> ExpertWeights:
        self.loads.append((layer, expert))
        buf[:2] = torch.tensor([layer, expert], dtype=torch.uint8)
        return ExpertWeights(gate_up=buf, down=None)


class Reader:
    """The reader's side the cache uses: a one-thread pool, held busy until `go` is set."""

    def __init__(self):
        self.pool, self.go, _ = blocked_pool()
        self.submit, self.submit_ahead = self.pool.submit, self.pool.submit_ahead
        self.promote, self.waiting_ahead = self.pool.promote, self.pool.waiting_ahead


def test_the_cache_queues_guesses_behind_a_steps_misses_and_promotes_the_one_it_needs():
    loader, reader = Loader(), Reader()
    cache = ExpertCache(loader, 8, 4096, [0, 1], submit=reader.submit, policy="lru", io_depth=2, ahead=reader)
    # io_depth 2 reads ahead may wait (the reader is busy): the third guess is not read
    assert cache.prefetch(1, [5, 6, 7]) == 2
    assert reader.waiting_ahead() == 2
    got = cache.fetch(0, [3])  # a step's miss: read before the guesses
    reader.go.set()
    assert [e for e, w in got if w.gate_up[:2].tolist() == [0, e]] == [3]
    assert [(e, w.gate_up[:2].tolist()) for e, w in cache.fetch(1, [6, 5])] == [(6, [1, 6]), (5, [1, 5])]
    assert loader.loads[0] == (0, 3) and sorted(loader.loads[1:]) == [(1, 5), (1, 6)]
    s = cache.stats()
    assert (s["prefetch_issued"], s["prefetch_used"], s["misses"]) == (2, 2, 1)
    reader.pool.shutdown()


def test_a_guess_the_step_needs_is_promoted_past_other_guesses():
    loader, reader = Loader(), Reader()
    cache = ExpertCache(loader, 8, 4096, [0, 1], submit=reader.submit, policy="lru", io_depth=4, ahead=reader)
    assert cache.prefetch(1, [5, 6, 7]) == 3
    it = cache.fetch(1, [7])  # 7 is a hit still queued: promoted ahead of 5 and 6
    reader.go.set()
    assert [e for e, _ in it] == [7]
    cache.drain()
    assert loader.loads == [(1, 7), (1, 5), (1, 6)]
    reader.pool.shutdown()
