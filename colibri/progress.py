"""A dependency-free progress bar on stderr (quiet when stderr is not a terminal unless forced)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "B", enabled: bool | None = None):
        self.total, self.desc, self.unit, self.n = max(total, 1), desc, unit, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = self._last = time.perf_counter()

    def update(self, n: int) -> None:
        self.n += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.n >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.n / self.total, 1.0)
        bar = "#" * int(frac * 30)
        rate = self.n / max(now - self.t0, 1e-9)
        amount = f"{self.n / 2**20:.0f}/{self.total / 2**20:.0f} MiB, {rate / 2**20:.0f} MiB/s" \
            if self.unit == "B" else f"{self.n}/{self.total}"
        sys.stderr.write(f"\r{self.desc}: [{bar:<30}] {frac * 100:5.1f}% ({amount})")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
