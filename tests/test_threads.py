"""Decode steps pick their thread count by timing (colibri/engine/threads.py)."""

from __future__ import annotations

from colibri.engine.threads import EXPLORE, RETRY_EVERY, DecodeThreads


def drive(dt: DecodeThreads, cost: dict[int, float], steps: int, rows: int = 1) -> list[int]:
    picks = []
    for _ in range(steps):
        n = dt.pick(rows)
        dt.record(rows, n, cost[n])
        picks.append(n)
    return picks


def test_explores_both_then_keeps_the_faster_and_retries_the_other():
    for fast, slow in ((1, 2), (2, 1)):
        dt = DecodeThreads(2)
        picks = drive(dt, {fast: 0.01, slow: 0.02}, 300)
        explore = picks[: 2 * (EXPLORE + 1)]
        assert explore.count(1) >= EXPLORE and explore.count(2) >= EXPLORE  # both timed first
        rest = picks[2 * (EXPLORE + 1):]
        assert rest.count(slow) <= len(rest) // RETRY_EVERY + 1  # the slow one only as a periodic retry
        assert rest.count(fast) > 0.95 * len(rest)


def test_follows_a_machine_that_changes():
    dt = DecodeThreads(2)
    drive(dt, {1: 0.02, 2: 0.01}, 200)  # quiet: 2 threads win
    picks = drive(dt, {1: 0.01, 2: 0.05}, 1000)  # a busy neighbour: 2 threads collapse
    assert picks[-200:].count(1) > 190


def test_row_counts_are_timed_apart_and_one_thread_needs_no_timing():
    dt = DecodeThreads(2)
    drive(dt, {1: 0.01, 2: 0.02}, 100, rows=1)
    drive(dt, {1: 0.04, 2: 0.02}, 100, rows=8)
    assert sum(dt.pick(1) == 1 for _ in range(50)) > 45
    assert sum(dt.pick(8) == 2 for _ in range(50)) > 45
    assert DecodeThreads(1).pick(4) == 1


def test_an_outlier_among_the_first_timings_does_not_decide():
    """One slow two-thread step early on (a server's HTTP thread running at that moment) must not keep
    decode on one thread: the choice follows the median of recent timings."""
    dt = DecodeThreads(2)
    seen = {"n": 0}

    def cost(n: int) -> float:
        if n == 2:
            seen["n"] += 1
            return 0.2 if seen["n"] == 3 else 0.01  # the second kept two-thread timing is an outlier
        return 0.015

    picks = []
    for _ in range(100):
        n = dt.pick(1)
        dt.record(1, n, cost(n))
        picks.append(n)
    assert picks[-50:].count(2) > 45


def test_more_threads_win_a_tie():
    dt = DecodeThreads(2)
    assert drive(dt, {1: 0.0100, 2: 0.0102}, 100)[-50:].count(2) > 45
