"""Reading container bytes into engine-owned memory: page-aligned buffers, pread, O_DIRECT.

The tiered store never touches the container's mapping for weights it must account for:
mapped pages count in RSS once touched and the kernel, not us, decides when they go.
Instead, bytes are read with `os.preadv` (which releases the GIL, so a small thread pool
overlaps reads with compute) into anonymous, page-aligned buffers that we own and reuse.

With `direct=True` the file is also opened with O_DIRECT: reads bypass the page cache (no
second copy of the weights in kernel memory, and ~2.5x the throughput of buffered reads on
the reference machine). O_DIRECT wants the buffer address, the file offset and the length
aligned to the device block size; records and standalone tensors start 4096-aligned in a
`.coli` file, buffers here are page-aligned and lengths are rounded up to 4096. Filesystems
that refuse O_DIRECT (tmpfs, some network file systems) answer EINVAL, at open or at the first
read; the reader then falls back to buffered reads for good.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import ColibriError
from ..format.integrity import Checks
from .iopool import IOPool

log = logging.getLogger("colibri")

ALIGN = 4096  # O_DIRECT alignment we guarantee: page size, and the .coli record/tensor alignment
# Reader threads, hence reads in flight at most: the store's default, and the queue depth the disk probe
# (analysis/probe.py) reads at, so that the planner's disk speed is the one the reader can reach.
IO_THREADS = 4
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class RecordReader:
    """preads byte ranges of one file into caller-owned CPU buffers, on a small thread pool.

    `read_into` is synchronous; `submit(fn, *args)` runs any callable (typically one that
    calls `read_into` then builds modules over the bytes) on the pool; `submit_ahead` the same
    after every job `submit` queued (the look-ahead's guesses: store/iopool.py). `direct` tells whether
    O_DIRECT is in use (it can turn False after a refused read). `bytes_read` counts every
    byte requested through this reader (thread-safe). With `checks`, every read of a whole
    record or tensor is checksummed before it returns (a ContainerError naming the tensor).
    `busy_s()` is the wall time during which at least one pread was in flight: bytes over it
    is the bandwidth the reader achieved at the queue depth it ran at.
    """

    def __init__(self, path: str | os.PathLike[str], threads: int = IO_THREADS, direct: bool = True,
                 checks: Checks | None = None):
        self.path = os.fspath(path)
        self.checks = checks
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ColibriError(f"cannot open {self.path}: {e.strerror or e}") from e
        self._dfd = -1
        if direct and _O_DIRECT:
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | _O_DIRECT)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise ColibriError(f"cannot open {self.path}: {e.strerror or e}") from e
                log.info("colibri: %s refuses O_DIRECT (%s); using buffered reads", self.path, e.strerror)
        self.direct = self._dfd >= 0
        self.requested_direct = direct
        self.file_size = os.fstat(self._fd).st_size
        self.threads = max(1, threads)
        self._pool = IOPool(self.threads)
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        # The union of the preads' intervals: overlapping reads count once, so this is wall time the
        # disk had work queued, not thread-seconds (which would divide the bandwidth by the depth).
        self._busy, self._active, self._since = 0.0, 0, 0.0

    def _fall_back(self, err: OSError) -> None:
        with self._lock:
            if self.direct:
                log.info("colibri: O_DIRECT read refused on %s (%s); using buffered reads", self.path,
                         err.strerror)
                self.direct = False

    def read_into(self, buf: torch.Tensor, offset: int, nbytes: int, check: bool = True) -> None:
        """Fill buf[:nbytes] with the file's bytes [offset, offset + nbytes), verified (see Checks).

        With O_DIRECT the read covers round_up(nbytes) bytes when `buf` has room for them
        (the tail beyond nbytes is garbage the caller ignores); otherwise it is buffered.
        """
        if nbytes == 0:
            return
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < nbytes or buf.device.type != "cpu":
            raise ValueError("read_into needs a 1-D uint8 CPU tensor with room for the bytes")
        view = memoryview(buf.numpy())
        span = min(round_up(nbytes), buf.numel())
        self._begin()
        try:
            got = self._pread(view, offset, nbytes, span, buf.data_ptr())
        finally:
            self._end()
        if got < nbytes:
            raise ColibriError(f"{self.path}: short read at offset {offset} ({got} of {nbytes} bytes)")
        if check and self.checks is not None:
            self.checks.after_read(buf, offset, nbytes)
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1

    def _pread(self, view: memoryview, offset: int, nbytes: int, span: int, addr: int) -> int:
        """O_DIRECT where the range and buffer allow (falling back for good if refused), else buffered."""
        if (self.direct and offset % ALIGN == 0 and span % ALIGN == 0
                and addr % ALIGN == 0):
            try:
                return _pread_full(self._dfd, view[:span], offset, nbytes)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._fall_back(e)
        return _pread_full(self._fd, view[:nbytes], offset, nbytes)

    def _begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def _end(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += time.perf_counter() - self._since

    def busy_s(self) -> float:
        """Wall seconds so far during which at least one pread was in flight (see the class doc)."""
        with self._lock:
            return self._busy + (time.perf_counter() - self._since if self._active else 0.0)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def submit_ahead(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit_ahead(fn, *args)

    def promote(self, f: Future) -> None:
        self._pool.promote(f)

    def waiting_ahead(self) -> int:
        return self._pool.waiting_ahead()

    def read_ranges(self, jobs: list[tuple[torch.Tensor, int, int]], chunk: int = 16 << 20) -> None:
        """Read many (buf, offset, nbytes) ranges in parallel, big ones split into chunks; waits.
        Each range is verified once all its chunks are in."""
        futs = []
        for buf, off, n in jobs:
            for pos in range(0, n, chunk):
                m = min(chunk, n - pos)
                futs.append(self._pool.submit(self.read_into, buf[pos:], off + pos, m, False))
        for f in futs:
            f.result()
        if self.checks is not None:
            for f in [self._pool.submit(self.checks.verify, buf, off, n) for buf, off, n in jobs]:
                f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dfd = -1


def _pread_full(fd: int, view: memoryview, offset: int, need: int) -> int:
    """preadv until `need` bytes are in (short counts happen); returns bytes read (may exceed need)."""
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
