"""Memory the decode kernels stream every token: page-aligned anonymous mappings that ask for huge pages.

Weights (store/) and KV caches (models/) both live here. A decode step reads each weight once and each
position's keys and values once; with 4 KiB pages that is a TLB miss every 4 KiB, and a page walk on
a VM is a nested one. Arenas from HUGE_MIN bytes carry MADV_HUGEPAGE, which the kernel honours where
transparent huge pages are `madvise` or `always` (the common defaults): measured ~5% a step on the
weights and ~15% on a long context's attention (docs/TIERS.md, "Loading").
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections.abc import Iterator

import torch

HUGE_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
HUGE_MIN = 4 << 20  # (below a few huge pages the advice buys little, and each one commits 2 MiB at once)
PAGE = mmap.PAGESIZE


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled, page-aligned 1-D uint8 CPU tensor backed by an anonymous mapping.

    Pages are only committed (and counted in RSS) once written, so a large arena costs what is
    actually filled (to the next 2 MiB where huge pages back it). The mapping lives as long as any
    tensor viewing it.
    """
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(-1, (nbytes + PAGE - 1) // PAGE * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_MIN and HUGE_ADVICE is not None:
        try:
            mm.madvise(HUGE_ADVICE)
        except OSError:  # (a kernel without THP refuses it: 4 KiB pages, as before)
            pass
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


def huge_pages_mib() -> float | None:
    """MiB of this process's anonymous memory in transparent huge pages (Linux /proc), None where unknown: what
    `--stats` and `colibri bench` report, so a user can see the advice taken."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("AnonHugePages:")) / 1024
    except (OSError, StopIteration, ValueError):
        return None


class _Pool:
    def __init__(self, nbytes: int):
        self.buf, self.off = aligned_buffer(nbytes), 0


class _Local(threading.local):
    pool: _Pool | None = None  # the `pooled` arena in force on this thread (class attribute: none at first)


_local = _Local()


@contextlib.contextmanager
def pooled(nbytes: int) -> Iterator[None]:
    """Inside, `zeros` carves its CPU tensors from one arena of `nbytes` (one slot's caches: huge pages
    even where each layer's keys are a few hundred KiB), each page-aligned; one that does not fit gets
    its own as outside. Below HUGE_MIN there is no pool."""
    prev = _local.pool
    _local.pool = _Pool(nbytes) if nbytes >= HUGE_MIN else None
    try:
        yield
    finally:
        _local.pool = prev


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape) for a cache preallocated for the whole context: a CPU tensor comes from the
    `pooled` arena in force, else from an arena of its own from HUGE_MIN bytes on (untouched positions
    then cost no RSS either), else from torch."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type == "cpu" and nbytes > 0:
        pool = _local.pool
        if pool is not None:
            off = -(-pool.off // PAGE) * PAGE
            if off + nbytes <= pool.buf.numel():
                pool.off = off + nbytes
                return pool.buf[off : off + nbytes].view(dtype).view(shape)
        if nbytes >= HUGE_MIN:
            return aligned_buffer(nbytes).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)
