"""Checksums of container bytes, and their check wherever bytes land in engine-owned memory.

New files carry a CRC-32C (Castagnoli) per tensor and per record under the key "crc32c",
computed by the `crc32c` package (SSE4.2 / ARMv8 CRC instructions, ~10+ GB/s per core, GIL
released on large buffers) -- fast enough to check every expert record on every read. Files
written before carry a zlib CRC-32 per tensor ("crc32"); they are checked with zlib, member by
member. `crc32c` is a core dependency; if it is missing anyway, `google_crc32c` is used when
installed, else the writer falls back to zlib "crc32" (still a valid file) and reading a
"crc32c" file raises a one-line error telling what to install. docs/FORMAT.md, "Checksums".

`Checks` maps every record and standalone tensor by file offset; the record reader calls
`after_read(buf, offset, nbytes)` once bytes are in, and a mismatch raises a ContainerError
naming the tensor before any module is built over the bytes.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any, NamedTuple

from ..errors import ContainerError

Crc = Callable[..., int]  # (buffer, running value) -> crc

try:
    import crc32c as _crc32c_mod

    def _crc32c(buf: Any, value: int = 0) -> int:
        return _crc32c_mod.crc32c(buf, value)

    BACKEND: str | None = "crc32c"
except ImportError:  # pragma: no cover - crc32c is a core dependency
    try:
        import google_crc32c as _g

        def _crc32c(buf: Any, value: int = 0) -> int:
            return _g.extend(value, bytes(buf))

        BACKEND = "google-crc32c"
    except ImportError:
        _crc32c = None  # type: ignore[assignment]
        BACKEND = None

_CHUNK = 8 << 20  # pread size of the open-time check of mapped spans
# The keys a tensor/record entry may carry, preferred first.
KEYS = ("crc32c", "crc32")


def writer_key() -> str:
    """The checksum a Writer stores: CRC-32C, or zlib CRC-32 when no CRC-32C module is installed."""
    return "crc32c" if BACKEND else "crc32"


def compute(key: str, buf: Any, value: int = 0) -> int:
    """Checksum `key` ("crc32c" or "crc32") of `buf` (bytes-like), continuing from `value`."""
    if key == "crc32":
        return zlib.crc32(buf, value)
    if _crc32c is None:
        raise ContainerError("this file's checksums are CRC-32C and no CRC-32C module is installed: "
                             "pip install crc32c")
    return _crc32c(buf, value)


def expected(entry: dict[str, Any]) -> tuple[str, int] | None:
    """(key, stored value) of an index entry's checksum, CRC-32C preferred; None if it has none."""
    for key in KEYS:
        v = entry.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return key, v
    return None


def mismatch(path: str, what: str, key: str, stored: int, got: int) -> ContainerError:
    return ContainerError(f"{path}: checksum mismatch in {what} (stored {key} {stored:#010x}, computed "
                          f"{got:#010x}); the file is damaged: re-convert or re-download it")


class _Part(NamedTuple):
    rel: int  # byte offset inside the span
    nbytes: int
    key: str
    crc: int
    what: str  # "tensor NAME" or "record NAME", for the error


class _Span(NamedTuple):
    nbytes: int
    parts: tuple[_Part, ...]
    members: tuple[_Part, ...]  # a record's member tensors: name the damaged one on a mismatch


class _Run(threading.local):
    """A span this thread is reading piece by piece: (start, span, end so far, crc so far), or None."""

    run: tuple[int, _Span, int, int] | None = None


class Checks:
    """The checksums of a container's records and standalone tensors, by file offset.

    `after_read` verifies a read that covers a whole span (a record or a tensor), and a span
    read in consecutive pieces by one thread (the GPU staging path); other reads (parts of a
    span read in parallel) are the caller's to check with `verify` once complete.
    """

    def __init__(self, path: str, header: dict[str, Any]):
        self.path = path
        self.spans: dict[int, _Span] = {}
        self.names: dict[int, tuple[str, bool]] = {}  # offset -> (record or tensor name, is a record)
        self.verified = 0  # bytes checked (tests and benchmarks read it)
        self.cpu_s = 0.0  # thread CPU seconds spent checksumming at run time (benchmarks/bench_verify.py)
        self._local = _Run()
        self._lock = threading.Lock()
        tensors, records = header.get("tensors", {}), header.get("records", {})
        for name, r in records.items():
            members = tuple(_part(tensors[f], f, r["offset"]) for f in r["tensors"].values() if f in tensors)
            own = expected(r)
            if own is not None:
                parts: tuple[_Part, ...] = (_Part(0, r["nbytes"], *own, f"record {name}"),)
            else:  # an older file: no record checksum, each member has its own
                parts = tuple(p for p in members if p.key)
            self.spans[r["offset"]] = _Span(r["nbytes"], parts, members)
            self.names[r["offset"]] = (name, True)
        for name, e in tensors.items():
            if "record" not in e and e["nbytes"] and e["offset"] not in self.spans:
                p = _part(e, name, e["offset"])
                self.spans[e["offset"]] = _Span(e["nbytes"], (p,) if p.key else (), ())
                self.names[e["offset"]] = (name, False)

    def verify(self, buf: Any, offset: int, nbytes: int) -> None:
        """Check `buf[:nbytes]` (a uint8 tensor or bytes-like) holding the span at `offset`; no-op
        if no span starts there with that size."""
        span = self.spans.get(offset)
        if span is None or span.nbytes != nbytes:
            return
        view = _bytes(buf)
        t0 = time.thread_time()
        for p in span.parts:
            got = compute(p.key, view[p.rel : p.rel + p.nbytes])
            if got != p.crc:
                raise self._damaged(view, span, p, got)
        with self._lock:
            self.verified += nbytes
            self.cpu_s += time.thread_time() - t0

    def after_read(self, buf: Any, offset: int, nbytes: int) -> None:
        """Called by the reader after buf[:nbytes] was filled from `offset` (on the reading thread)."""
        span = self.spans.get(offset)
        if span is not None and span.nbytes == nbytes:
            self.verify(buf, offset, nbytes)
            return
        run = self._local.run
        if span is not None and nbytes < span.nbytes and len(span.parts) == 1 and span.parts[0].nbytes == span.nbytes:
            # the first piece of a span read piece by piece, in order, by this thread
            p = span.parts[0]
            self._local.run = (offset, span, offset + nbytes, compute(p.key, _bytes(buf)[:nbytes]))
            return
        if run is not None and offset == run[2]:
            start, span, _, crc = run
            p = span.parts[0]
            crc = compute(p.key, _bytes(buf)[:nbytes], crc)
            end = offset + nbytes
            if end < start + span.nbytes:
                self._local.run = (start, span, end, crc)
                return
            self._local.run = None
            if end == start + span.nbytes:
                if crc != p.crc:
                    raise mismatch(self.path, p.what, p.key, p.crc, crc)
                with self._lock:
                    self.verified += span.nbytes

    def verify_mapped(self, submit: Callable[..., Any], mapped: Callable[[str, bool], bool]) -> int:
        """Check once, before use, the spans the engine will use through the file's mapping
        (`mapped(name, is_record)` picks them); returns the bytes checked. Reads with buffered
        pread on the `submit` pool, never through the mapping: RSS stays as lazy as the mapping's,
        and the page cache keeps the bytes for the faults that follow."""
        offsets = sorted(off for off, (name, rec) in self.names.items() if mapped(name, rec))
        fd = os.open(self.path, os.O_RDONLY)
        futs = []
        try:
            futs = [submit(self._verify_fd, fd, off) for off in offsets]
        finally:
            wait(futs)  # every read done before the fd closes (a reused fd number would read another file)
            os.close(fd)
        return sum(f.result() for f in futs)  # the first damaged span in file order raises

    def _verify_fd(self, fd: int, offset: int) -> int:
        span = self.spans[offset]
        buf = memoryview(bytearray(min(_CHUNK, span.nbytes)))
        for p in span.parts:
            crc, pos, end = 0, offset + p.rel, offset + p.rel + p.nbytes
            while pos < end:
                n = os.preadv(fd, [buf[: min(_CHUNK, end - pos)]], pos)
                if n <= 0:
                    raise ContainerError(f"{self.path}: short read in {p.what}")
                crc = compute(p.key, buf[:n], crc)
                pos += n
            if crc != p.crc:
                if span.members and p.what.startswith("record "):  # name the member: read it whole
                    whole = bytearray(span.nbytes)
                    os.preadv(fd, [whole], offset)
                    raise self._damaged(memoryview(whole), span, p, crc)
                raise mismatch(self.path, p.what, p.key, p.crc, crc)
        with self._lock:
            self.verified += span.nbytes
        return span.nbytes

    def _damaged(self, view: memoryview, span: _Span, p: _Part, got: int) -> ContainerError:
        # A record-wide mismatch: name the member whose own checksum fails, if one does.
        for m in span.members if p.what.startswith("record ") else ():
            if m.key and compute(m.key, view[m.rel : m.rel + m.nbytes]) != m.crc:
                return mismatch(self.path, f"{m.what} ({p.what})", p.key, p.crc, got)
        return mismatch(self.path, p.what, p.key, p.crc, got)


def _part(e: dict[str, Any], name: str, base: int) -> _Part:
    key, crc = expected(e) or ("", 0)
    return _Part(e["offset"] - base, e["nbytes"], key, crc, f"tensor {name}")


def _bytes(buf: Any) -> memoryview:
    """A flat byte view of a uint8 CPU tensor, or of any bytes-like object."""
    if hasattr(buf, "numpy"):
        return memoryview(buf.numpy()).cast("B")
    return memoryview(buf).cast("B")
