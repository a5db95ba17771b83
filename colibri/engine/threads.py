"""How many threads a decode step runs on: measured, not assumed.

A decode step is a few dozen native kernels (colibri/kernels/) over 0.5-4 MiB of weights each, with
Python between them. Whether the second core pays depends on the machine and on what else runs on it
(with OpenMP it once lost: 47 tok/s on 1 thread, 29 on 2, on a 0.44B model; with the native pool two
threads usually win). So decode-only steps pick their thread count by timing: the first steps
alternate between 1 and all threads, then the faster runs, and the other is re-timed now and then,
so a machine that turns busy (or quiet) is followed. Prefill steps always use every thread. The
kernels give the same bits on 1 and 2 threads (they split the output, not the reduction); the
batch-vs-solo identity tests run through this.
"""

from __future__ import annotations

EXPLORE = 4  # timed steps per candidate before choosing
RETRY_EVERY = 32  # then one step of the other candidate every this many steps
WINDOW = 7  # a candidate's speed: the median of its last WINDOW timings
MARGIN = 0.05  # fewer threads must be this much faster to be chosen (more threads: the usual winner)


class DecodeThreads:
    """`pick(rows)` -> threads for a decode-only step of `rows` rows; `record(rows, n, seconds)` after it.

    Medians, not running means: in a server, a step now and then waits on the HTTP thread or a client
    process, and one such outlier among the first timings kept a running mean -- and the choice --
    on one thread for hundreds of steps (measured: 89-106 tok/s against 123-149 with two threads)."""

    def __init__(self, threads: int):
        self.candidates = (1, threads) if threads > 1 else (1,)
        self.times: dict[tuple[int, int], list[float]] = {}  # (rows bucket, threads) -> last timings
        self.count: dict[tuple[int, int], int] = {}
        self.steps: dict[int, int] = {}

    @staticmethod
    def _bucket(rows: int) -> int:
        return min(rows.bit_length(), 6)  # 1, 2-3, 4-7, ... 32+: a step's cost grows with its rows

    def _median(self, key: tuple[int, int]) -> float:
        ts = sorted(self.times[key])
        return ts[len(ts) // 2]

    def exploring(self, rows: int) -> bool:
        """Whether steps of `rows` rows are still timing both candidates (the runner then keeps them
        single steps: a native run of several at the slower count would cost that many steps)."""
        b = self._bucket(rows)
        return len(self.candidates) > 1 and min(self.count.get((b, t), 0) for t in self.candidates) <= EXPLORE

    def pick(self, rows: int) -> int:
        if len(self.candidates) == 1:
            return 1
        b = self._bucket(rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        seen = [self.count.get((b, t), 0) for t in self.candidates]
        if min(seen) <= EXPLORE:  # alternate until each has been timed (the first timing is not kept)
            return self.candidates[n % 2]
        few, many = self.candidates
        best = few if self._median((b, few)) < (1 - MARGIN) * self._median((b, many)) else many
        if n % RETRY_EVERY == 0:
            return many if best == few else few
        return best

    def record(self, rows: int, threads: int, seconds: float) -> None:
        key = (self._bucket(rows), threads)
        c = self.count[key] = self.count.get(key, 0) + 1
        # The first timing of each bucket warms caches and allocators: counted, not kept.
        if c == 1:
            return
        ts = self.times.setdefault(key, [])
        ts.append(seconds)
        if len(ts) > WINDOW:
            del ts[0]
