"""What one forward step runs over: the rows of several sequences, each with its own KV slot.

A step's hidden states are one `[T, H]` tensor: the rows of sequence 0, then those of sequence 1,
and so on (a prefill chunk is many rows of one sequence; a decode step is one row per sequence).
Everything but attention treats the rows as one batch (projections, norms, the experts: the MoE
layer sees the union of experts over all rows); attention runs per sequence on its own cache and
positions, so nobody is padded to the longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Seq:
    """One sequence's rows in a step: rows [r0, r1) at positions start..start + (r1 - r0)."""

    r0: int
    r1: int
    start: int
    caches: list  # this sequence's per-layer caches (its slot)


class LayerKV:
    """The view of a step one layer's attention gets: per sequence (r0, r1, start, its cache for this
    layer), and the rows' positions (an int start when there is one sequence, else a [T] tensor)."""

    __slots__ = ("segs", "pos")

    def __init__(self, segs: list[tuple[int, int, int, object]], pos: int | torch.Tensor):
        self.segs, self.pos = segs, pos

    @property
    def end(self) -> int:
        """One past the step's last position (a limit the layer checks before its native block)."""
        return max(start + r1 - r0 for r0, r1, start, _ in self.segs)


class StepBatch:
    """The sequences of one forward step; `layer(i)` is layer i's `LayerKV`."""

    def __init__(self, seqs: list[Seq]):
        self.seqs = seqs
        self.n_rows = seqs[-1].r1 if seqs else 0
        self._pos: int | torch.Tensor | None = seqs[0].start if len(seqs) == 1 else None

    @property
    def pos(self) -> int | torch.Tensor:
        """The rows' positions: an int start for one sequence, else int64 [T] (made on first use: the
        one-call native step never asks)."""
        if self._pos is None:
            self._pos = torch.tensor([p for s in self.seqs for p in range(s.start, s.start + s.r1 - s.r0)])
        return self._pos

    @classmethod
    def single(cls, caches: list, start: int, n: int) -> StepBatch:
        """One sequence of n rows from `start` (a plain prefill or decode of one slot)."""
        return cls([Seq(0, n, start, caches)])

    def layer(self, i: int) -> LayerKV:
        return LayerKV([(s.r0, s.r1, s.start, s.caches[i]) for s in self.seqs], self.pos)
