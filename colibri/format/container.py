"""The `.coli` container: one versioned, memory-mappable file per model.

Layout (spec: docs/FORMAT.md):

    [0, 4096)             preamble: magic, version, flags, header location, crc, file size
    [4096, header_offset) tensor data; standalone tensors and records start 4096-aligned,
                          record members are packed 64-aligned inside their record
    [header_offset, EOF)  JSON header (utf-8): meta + tensor index + record index

The header lives at the end so `Writer` can stream tensors of unknown total
size straight to disk and only then describe them. `Container` reads the
preamble and header with pread and maps the rest lazily, so opening a 100 GB
model costs a few MB of RSS; tensor data is faulted in only when touched.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from colibri.errors import ColibriError, ContainerError
from colibri.format import integrity, validate
from colibri.format.layout import (
    ALIGN,
    DTYPE_CODES,
    DTYPES,
    FORMAT_VERSION,
    ITEMSIZE,
    MAGIC,
    MEMBER_ALIGN,
    PREAMBLE_SIZE,
)

# magic, version, flags, header_offset, header_len, header_crc32, file_size
_PREAMBLE = struct.Struct("<8sIIQQIQ")
_VERIFY_CHUNK = 8 << 20
# A header is an index plus tokenizer/config text; 1 GiB means garbage, not a model.
_MAX_HEADER = 1 << 30

# Keys the format owns in a tensor entry; writer attrs may not shadow them.
_RESERVED = frozenset({"dtype", "shape", "offset", "nbytes", "crc32", "crc32c", "record"})

TensorSpec = torch.Tensor | tuple[torch.Tensor, Mapping[str, Any]]


def dtype_code(dtype: torch.dtype) -> str:
    """The header code ("bf16", ...) of a torch dtype; ContainerError if unsupported."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ContainerError(f"unsupported dtype {dtype} (supported: {', '.join(DTYPES)})") from None


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _as_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A flat byte view of `t` sharing its memory (a copy only if t is non-contiguous/off-CPU).

    Returns the backing tensor too: the memoryview does not keep it alive by itself.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # numpy has no bfloat16; its bytes are the same as int16's.
    src = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return t, memoryview(src.numpy().reshape(-1).view(np.uint8))


class Writer:
    """Streams tensors into a new container; the file appears at `path` only on success.

    Data goes to `path + ".tmp-<pid>"`; `close()` appends the header, writes the
    preamble, fsyncs and renames atomically. Used as a context manager, an
    exception discards the temp file and leaves any existing `path` untouched.
    `meta` stays mutable (`writer.meta`) until `close()`.
    """

    def __init__(self, path: str | os.PathLike[str], meta: Mapping[str, Any] | None = None):
        self.path = os.fspath(path)
        self.tmp_path = f"{self.path}.tmp-{os.getpid()}"
        self.meta: dict[str, Any] = dict(meta or {})
        self._tensors: dict[str, dict[str, Any]] = {}
        self._records: dict[str, dict[str, Any]] = {}
        try:
            # 1 MiB buffer: padding and small tensors coalesce; large ones bypass it.
            self._f = open(self.tmp_path, "wb", buffering=1 << 20)
        except OSError as e:
            raise ContainerError(f"cannot create {self.tmp_path}: {e.strerror or e}") from e
        self._closed = False
        # CRC-32C (zlib CRC-32 without a CRC-32C module): per tensor, and per record over its whole
        # byte range, padding included, so one check covers a record read (colibri/format/integrity.py).
        self._key = integrity.writer_key()
        self._rec_crc: int | None = None  # running checksum of the record being written
        # Reserve the preamble; it is filled in last, when the header location is known.
        self._f.write(bytes(PREAMBLE_SIZE))
        self._pos = PREAMBLE_SIZE

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise ContainerError(f"writer for {self.path} is already closed")

    def _out(self, buf: bytes | memoryview) -> None:
        try:
            self._f.write(buf)
        except OSError as e:  # e.g. disk full: a user-facing error, not a traceback
            raise ContainerError(f"cannot write {self.tmp_path}: {e.strerror or e}") from e
        self._pos += len(buf) if isinstance(buf, bytes) else buf.nbytes
        if self._rec_crc is not None:
            self._rec_crc = integrity.compute(self._key, buf, self._rec_crc)

    def _pad_to(self, a: int) -> None:
        pad = _align(self._pos, a) - self._pos
        if pad:
            self._out(bytes(pad))

    def _check(self, name: object, tensor: object, attrs: Mapping[str, Any]) -> None:
        """Refuse a bad tensor before any byte of it is written (no half-written entries)."""
        if not isinstance(name, str) or not name:
            raise ContainerError(f"tensor name must be a non-empty string, got {name!r}")
        if name in self._tensors:
            raise ContainerError(f"duplicate tensor name {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ContainerError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        bad = _RESERVED.intersection(attrs)
        if bad:
            raise ContainerError(f"tensor {name!r}: attribute(s) {sorted(bad)} are reserved by the format")
        try:
            dtype_code(tensor.dtype)
            # Checked now rather than in close(), where the error could no longer name the tensor.
            json.dumps(attrs, allow_nan=False)
        except ContainerError as e:
            raise ContainerError(f"tensor {name!r}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ContainerError(f"tensor {name!r}: attributes are not strict JSON: {e}") from None

    def _write(self, name: str, tensor: torch.Tensor, attrs: Mapping[str, Any]) -> dict[str, Any]:
        keep, buf = _as_bytes(tensor)
        entry: dict[str, Any] = {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(keep.shape),
            "offset": self._pos,
            "nbytes": buf.nbytes,
            # computed from the same buffer we write: one extra read pass, no copy.
            self._key: integrity.compute(self._key, buf),
            **attrs,
        }
        if buf.nbytes:
            self._out(buf)
        self._tensors[name] = entry
        return entry

    def add_tensor(self, name: str, tensor: torch.Tensor, **attrs: Any) -> None:
        """Write one standalone tensor (4096-aligned); `attrs` (JSON values) go in its entry."""
        self._check_open()
        self._check(name, tensor, attrs)
        self._pad_to(ALIGN)
        self._write(name, tensor, attrs)

    def add_record(self, name: str, members: Mapping[str, TensorSpec]) -> None:
        """Write `members` as one contiguous 4096-aligned record, so a single read fetches it.

        Each member is `tensor` or `(tensor, attrs)` and also becomes a tensor entry
        named f"{name}.{subname}"; members are packed 64-aligned in the given order.
        """
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ContainerError(f"record name must be a non-empty string, got {name!r}")
        if name in self._records:
            raise ContainerError(f"duplicate record name {name!r}")
        if not members:
            raise ContainerError(f"record {name!r} has no members")
        # Check every member before writing any, so a refused call leaves no partial record.
        parts: list[tuple[str, str, torch.Tensor, Mapping[str, Any]]] = []
        for sub, spec in members.items():
            tensor, attrs = (spec, {}) if isinstance(spec, torch.Tensor) else spec
            full = f"{name}.{sub}"
            self._check(full, tensor, attrs)
            parts.append((sub, full, tensor, attrs))
        self._pad_to(ALIGN)
        start = self._pos
        self._rec_crc = 0
        try:
            for _, full, tensor, attrs in parts:
                self._pad_to(MEMBER_ALIGN)
                self._write(full, tensor, attrs)["record"] = name
            crc = self._rec_crc
        finally:
            self._rec_crc = None
        members_index = {sub: full for sub, full, _, _ in parts}
        self._records[name] = {"offset": start, "nbytes": self._pos - start, "tensors": members_index,
                               self._key: crc}

    def close(self) -> None:
        """Append the header, fill the preamble, fsync and atomically rename into place."""
        if self._closed:
            return
        try:
            header = {"format": "colibri", "version": FORMAT_VERSION, "meta": self.meta,
                      "tensors": self._tensors, "records": self._records}  # fmt: skip
            try:
                # Strict JSON (no NaN/Infinity) so readers in any language can parse it.
                blob = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
                data = blob.encode("utf-8")
            except (TypeError, ValueError) as e:
                raise ContainerError(f"cannot write {self.path}: header is not valid JSON: {e}") from e
            h_off = self._pos
            self._f.write(data)
            n = len(data)
            pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, h_off, n, zlib.crc32(data), h_off + n)
            self._f.seek(0)
            self._f.write(pre)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp_path, self.path)
        except OSError as e:
            self.abort()
            raise ContainerError(f"cannot write {self.path}: {e.strerror or e}") from e
        except BaseException:
            self.abort()
            raise
        self._closed = True
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Discard everything written so far; `path` is never created or modified."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp_path)


def _fsync_dir(d: str) -> None:
    # Makes the rename itself durable; best effort (not every platform/filesystem allows it).
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset`; pread may return short counts, so loop. Returns bytes read."""
    done = 0
    while done < buf.nbytes:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Container:
    """A read-only view of a `.coli` file: header parsed on open, tensors mmapped on demand.

    `tensor()` returns zero-copy views into a private (copy-on-write) mapping:
    writing to them never reaches the file. Views stay valid after `close()`.
    `fd` is an O_RDONLY descriptor for pread users (e.g. the expert cache).
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool = False):
        self.path = os.fspath(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ContainerError(f"cannot open {self.path}: {e.strerror or e}") from e
        self._mm: mmap.mmap | None = None
        self._layouts: dict[str, dict[str, Any]] = {}
        try:
            self._load()
            if verify:
                self.verify()
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    def _fail(self, msg: str) -> ContainerError:
        return ContainerError(f"{self.path}: {msg}")

    def _load(self) -> None:
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode) and os.path.isfile(os.path.join(self.path, "config.json")):
                raise ContainerError(f"{self.path} is a Hugging Face folder: convert it first: "
                                     f"colibri convert -i {self.path} -o OUT.coli")
            raise ContainerError(f"cannot open {self.path}: not a regular file")
        size = st.st_size
        if size == 0:
            raise ContainerError(f"{self.path} is empty, not a colibri container")
        pre = os.pread(self.fd, PREAMBLE_SIZE, 0)
        if pre[: len(MAGIC)] != MAGIC:
            raise ContainerError(f"{self.path} is not a colibri container (bad magic)")
        if size < PREAMBLE_SIZE:
            raise self._fail(f"truncated: expected at least {PREAMBLE_SIZE} bytes, found {size}")
        _, version, self.flags, h_off, h_len, h_crc, file_size = _PREAMBLE.unpack_from(pre)
        if version > FORMAT_VERSION:
            raise self._fail(
                f"format version {version} is newer than this colibri supports ({FORMAT_VERSION}); "
                "upgrade colibri"
            )
        if version < 1:
            raise self._fail(f"invalid format version {version}")
        if size != file_size:
            what = "truncated" if size < file_size else "size mismatch"
            raise self._fail(f"{what}: expected {file_size} bytes, found {size}")
        # The header must end the file exactly: nothing unindexed can hide after it.
        if h_off < PREAMBLE_SIZE or h_len > _MAX_HEADER or h_off + h_len != file_size:
            raise self._fail(f"corrupt preamble: header at [{h_off}, {h_off + h_len}) in a {size}-byte file")
        self.version = version
        self.file_size = size
        self.data_end = h_off  # tensor data lives in [PREAMBLE_SIZE, data_end)
        raw = bytearray(h_len)
        if _pread_into(self.fd, memoryview(raw), h_off) != h_len:
            raise self._fail("truncated header")
        if zlib.crc32(raw) != h_crc:
            raise self._fail("header checksum mismatch (file is damaged)")
        try:
            header = validate.loads(raw, "header")
            validate.check_index(header, version, self.data_end)
            # A model container (one with a model_type): its config, quant and tokenizer against the index.
            if "model_type" in header["meta"]:
                validate.check_model(header["meta"], header["tensors"], header["records"])
        except ContainerError:
            raise
        except ColibriError as e:
            raise self._fail(str(e)) from None
        self.header: dict[str, Any] = header
        self.meta: dict[str, Any] = header["meta"]
        self._tensors: dict[str, dict[str, Any]] = header["tensors"]
        self._records: dict[str, dict[str, Any]] = header["records"]
        # Mapping reads nothing; pages are faulted in from the page cache on first touch.
        # ACCESS_COPY (MAP_PRIVATE) gives a writable buffer, which torch.frombuffer needs
        # to stay silent; clean pages remain shared with the page cache.
        self._mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)

    def close(self) -> None:
        """Close the fd. The mapping is dropped, not closed: views handed out keep it alive."""
        # torch.frombuffer holds a reference to the mmap but no buffer export, so an
        # explicit mmap.close() would leave live tensors pointing at unmapped memory.
        self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Safety net for containers never closed; may run during interpreter shutdown.
        if getattr(self, "fd", -1) >= 0:
            with contextlib.suppress(Exception):
                self.close()

    def fileno(self) -> int:
        return self.fd

    def __repr__(self) -> str:
        return f"Container({self.path!r}, tensors={len(self._tensors)}, records={len(self._records)})"

    @property
    def model_type(self) -> str | None:
        t = self.meta.get("model_type")
        return t if isinstance(t, str) else None

    # Checked at open in a model container; other containers' meta is free-form, so these never raise.
    @property
    def config(self) -> dict[str, Any]:
        c = self.meta.get("config")
        return c if isinstance(c, dict) else {}

    @property
    def quant(self) -> dict[str, Any]:
        q = self.meta.get("quant")
        return q if isinstance(q, dict) else {}

    def names(self) -> list[str]:
        """All tensor names (record members included), in file order."""
        return list(self._tensors)

    def record_names(self) -> list[str]:
        return list(self._records)

    def has(self, name: str) -> bool:
        return name in self._tensors

    __contains__ = has

    def has_record(self, name: str) -> bool:
        return name in self._records

    def info(self, name: str) -> dict[str, Any]:
        """A copy of the tensor's header entry (dtype, shape, offset, nbytes, crc32, attrs)."""
        try:
            return dict(self._tensors[name])
        except KeyError:
            raise self._fail(f"no tensor named {name!r}") from None

    def _layout(self, name: str) -> dict[str, Any]:
        # Cached: the expert cache resolves layouts on every fetch, in the decode hot path.
        lay = self._layouts.get(name)
        if lay is None:
            try:
                r = self._records[name]
            except KeyError:
                raise self._fail(f"no record named {name!r}") from None
            members = {}
            for sub, full in r["tensors"].items():
                e = self._tensors[full]
                members[sub] = {**e, "name": full, "rel_offset": e["offset"] - r["offset"]}
            lay = self._layouts[name] = {**r, "members": members}
        return lay

    def record(self, name: str) -> dict[str, Any]:
        """The record entry (offset, nbytes, tensors: sub -> full name) plus `members`:
        sub -> tensor entry with `name` and `rel_offset` (byte offset inside the record)."""
        lay = self._layout(name)
        members = {sub: dict(m) for sub, m in lay["members"].items()}
        return {**lay, "tensors": dict(lay["tensors"]), "members": members}

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of the tensor's bytes in the mapping, with its dtype and shape."""
        e = self.info(name)
        dtype = DTYPES[e["dtype"]]
        if e["nbytes"] == 0:
            return torch.empty(e["shape"], dtype=dtype)  # frombuffer refuses empty ranges
        if self._mm is None:
            raise self._fail("container is closed")
        count = e["nbytes"] // ITEMSIZE[e["dtype"]]
        return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=e["offset"]).view(e["shape"])

    def record_views(self, name: str, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views (sub -> tensor) into `buf`, a uint8 tensor holding the record's bytes."""
        r = self._layout(name)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < r["nbytes"]:
            raise self._fail(f"record {name}: buffer must be a 1-D uint8 tensor of >= {r['nbytes']} bytes")
        out = {}
        for sub, m in r["members"].items():
            raw = buf[m["rel_offset"] : m["rel_offset"] + m["nbytes"]]
            # Members are 64-aligned in the record, so the dtype reinterpretation is legal.
            out[sub] = raw.view(DTYPES[m["dtype"]]).view(m["shape"])
        return out

    def verify(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Check every tensor's crc32c (crc32 in older files), streaming with pread (not the mmap):
        RSS stays flat.

        `progress(done_bytes, total_bytes)` is called after each chunk.
        Raises ContainerError naming the first tensor (in file order) whose data is damaged.
        """
        if self.fd < 0:
            raise self._fail("container is closed")
        entries = sorted(self._tensors.items(), key=lambda kv: kv[1]["offset"])
        total = sum(e["nbytes"] for _, e in entries)
        buf = memoryview(bytearray(_VERIFY_CHUNK))
        done = 0
        for name, e in entries:
            key, want = integrity.expected(e) or ("crc32", -1)  # (_validate guarantees one)
            crc, pos, end = 0, e["offset"], e["offset"] + e["nbytes"]
            while pos < end:
                n = _pread_into(self.fd, buf[: min(_VERIFY_CHUNK, end - pos)], pos)
                if n == 0:
                    raise self._fail(f"tensor {name}: short read")
                crc = integrity.compute(key, buf[:n], crc)
                pos += n
                done += n
                if progress is not None:
                    progress(done, total)
            if crc != want:
                raise self._fail(f"checksum mismatch in tensor {name} "
                                 f"(stored {key} {want:#010x}, computed {crc:#010x})")
        if progress is not None:
            progress(done, total)

    def summary(self) -> str:
        """Multi-line human description, printed by `colibri inspect`."""
        cfg = self.config
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        lines = [f"file:        {self.path} ({_human(self.file_size)}, format v{self.version})"]
        lines.append(f"model_type:  {self.model_type or '?'}")
        keys = (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "n_routed_experts",
            "num_local_experts", "num_experts_per_tok", "n_shared_experts", "vocab_size",
            "max_position_embeddings",
        )  # fmt: skip
        for k in keys:
            v = cfg.get(k, text_cfg.get(k))
            if v is not None:
                lines.append(f"  {k + ':':<25}{v}")
        q = self.quant
        if q:
            lines.append("quant:       " + ", ".join(f"{k}={v}" for k, v in q.items()))
        by_dtype: dict[str, int] = {}
        for e in self._tensors.values():
            by_dtype[e["dtype"]] = by_dtype.get(e["dtype"], 0) + e["nbytes"]
        lines.append(f"tensors:     {len(self._tensors)}")
        lines.append(f"records:     {len(self._records)}")
        lines.append(f"data:        {_human(sum(by_dtype.values()))}")
        for dt, nb in sorted(by_dtype.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {dt + ':':<25}{_human(nb)}")
        mtp = [e["nbytes"] for n, e in self._tensors.items() if n.startswith("mtp.")]  # (layers/mtp.py)
        if mtp:
            layers = {n.split(".")[1] for n in self._tensors if n.startswith("mtp.")}
            lines.append(f"mtp:         {len(layers)} multi-token-prediction layer(s), {_human(sum(mtp))} "
                         "(drafts for --spec mtp; RAM beside the model's weights)")
        conv = self.meta.get("converter")
        if isinstance(conv, dict):
            # Lists (e.g. dropped source tensors) can run to thousands of names: show counts.
            items = (f"{k}={len(v)}" if isinstance(v, list | dict) else f"{k}={v}" for k, v in conv.items())
            lines.append("converter:   " + ", ".join(items))
        return "\n".join(lines)
