"""How many threads a decode step runs on: measured, not assumed.

A decode step is hundreds of small kernels (one-row GEMVs of 0.5-4 MiB). With OpenMP, every kernel
forks and joins the team; on small matrices that costs more than the second core gives (measured on
a 2-core VM: a 0.44B OLMoE-shaped int8 model decodes at 47 tok/s on 1 thread and 29 on 2), while on
larger ones the second core wins (~+16% on the 7B shape). So decode-only steps pick their thread
count by timing: the first steps alternate between 1 and all threads, then the faster runs, and the
other is re-timed now and then, so a machine that turns busy (or quiet) is followed. Prefill steps
always use every thread. The kernels give the same bits on 1 and 2 threads (they split the output,
not the reduction); the batch-vs-solo identity tests run through this.
"""

from __future__ import annotations

EXPLORE = 4  # timed steps per candidate before choosing
RETRY_EVERY = 64  # then one step of the other candidate every this many steps
SMOOTH = 0.25  # weight of a new timing in the running mean


class DecodeThreads:
    """`pick(rows)` -> threads for a decode-only step of `rows` rows; `record(rows, n, seconds)` after it."""

    def __init__(self, threads: int):
        self.candidates = (1, threads) if threads > 1 else (1,)
        self.mean: dict[tuple[int, int], float] = {}  # (rows bucket, threads) -> seconds per step
        self.count: dict[tuple[int, int], int] = {}
        self.steps: dict[int, int] = {}

    @staticmethod
    def _bucket(rows: int) -> int:
        return min(rows.bit_length(), 6)  # 1, 2-3, 4-7, ... 32+: a step's cost grows with its rows

    def pick(self, rows: int) -> int:
        if len(self.candidates) == 1:
            return 1
        b = self._bucket(rows)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        seen = [self.count.get((b, t), 0) for t in self.candidates]
        if min(seen) < EXPLORE:  # alternate until each has been timed
            return self.candidates[n % 2]
        best = min(self.candidates, key=lambda t: self.mean[(b, t)])
        if n % RETRY_EVERY == 0:
            return next(t for t in self.candidates if t != best)
        return best

    def record(self, rows: int, threads: int, seconds: float) -> None:
        key = (self._bucket(rows), threads)
        c = self.count[key] = self.count.get(key, 0) + 1
        # The first timing of each bucket warms caches and allocators: counted, not averaged in.
        if c == 1:
            return
        prev = self.mean.get(key)
        self.mean[key] = seconds if prev is None else prev + SMOOTH * (seconds - prev)
