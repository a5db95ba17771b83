"""Lazy reader for Hugging Face safetensors shards: headers only on open, each tensor read with pread.

Reading with pread into a fresh buffer (not through mmap) keeps the converter's RSS near the
largest tensor it holds, not the size of the checkpoint.
"""

from __future__ import annotations

import os
import struct
from math import prod
from pathlib import Path
from typing import Any

import torch

from ..errors import ColibriError
from ..format.validate import is_int, loads

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _entries(f: Path, header: Any, data_len: int) -> dict[str, dict]:
    """The header's tensor entries, checked as the safetensors library checks them: each a known
    dtype, a non-negative integer shape, offsets inside the data whose size is the shape's, and the
    tensors covering the data exactly (no overlap, no hole)."""
    if not isinstance(header, dict):
        raise ColibriError(f"{f}: corrupt safetensors header (not a JSON object)")
    out, spans = {}, []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        where = f"{f}: tensor {name}"
        if not isinstance(e, dict):
            raise ColibriError(f"{where}: header entry is not an object")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dt, str):
            raise ColibriError(f"{where}: no dtype")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise ColibriError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(is_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_len):
            raise ColibriError(f"{where}: data_offsets {offs!r} are not a range inside the {data_len} data bytes")
        if dt in DTYPES and prod(shape) * DTYPES[dt].itemsize != offs[1] - offs[0]:
            raise ColibriError(f"{where}: {dt} shape {shape} needs {prod(shape) * DTYPES[dt].itemsize} bytes, "
                               f"data_offsets give {offs[1] - offs[0]}")
        out[name] = e
        spans.append((offs[0], offs[1], name))
    spans.sort()
    end = 0
    for start, stop, name in spans:
        if start != end:
            what = "overlaps the previous tensor" if start < end else "leaves a hole before it"
            raise ColibriError(f"{f}: tensor {name} {what} (data_offsets start at {start}, expected {end})")
        end = stop
    if end != data_len:
        raise ColibriError(f"{f}: the tensors cover {end} of the file's {data_len} data bytes (truncated or padded)")
    return out


class SafetensorsFolder:
    """All tensors of the `*.safetensors` files in an HF model folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ColibriError(f"no *.safetensors files in {self.folder}")
        self.entries: dict[str, tuple[Path, dict, int]] = {}  # name -> (file, header entry, data start)
        for f in files:
            with open(f, "rb") as fh:
                raw = fh.read(8)
                if len(raw) != 8:
                    raise ColibriError(f"{f} is not a safetensors file (too short)")
                (n,) = struct.unpack("<Q", raw)
                size = os.path.getsize(f)
                if n > size - 8:
                    raise ColibriError(f"{f} is not a safetensors file (bad header length)")
                header = loads(fh.read(n), f"{f}: the safetensors header")
            for name, e in _entries(f, header, size - 8 - n).items():
                if name in self.entries:
                    raise ColibriError(f"tensor {name} is in both {self.entries[name][0]} and {f}")
                self.entries[name] = (f, e, 8 + n)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def dtype(self, name: str) -> str:
        return self.entries[name][1]["dtype"]

    def nbytes(self, name: str) -> int:
        a, b = self.entries[name][1]["data_offsets"]
        return b - a

    def read(self, name: str, index: int | None = None, of: int | None = None) -> torch.Tensor:
        """The tensor, or its `index`-th slice along dim 0 (one expert of a fused [E, ...] tensor); with `of`,
        its `index`-th of `of` equal row blocks (one expert of DBRX's [E·I, H])."""
        path, e, base = self.entries[name]
        if e["dtype"] not in DTYPES:
            raise ColibriError(f"tensor {name} has dtype {e['dtype']}, which colibri cannot convert")
        dtype, shape = DTYPES[e["dtype"]], list(e["shape"])
        start, end = e["data_offsets"]
        if index is not None:
            n = shape[0] if shape and of is None else of
            if not shape or not n or shape[0] % n or not 0 <= index < n:
                raise ColibriError(f"tensor {name} {list(shape)} has no slice {index} of {n} along its first dimension")
            row = (end - start) // n
            start, end = start + index * row, start + (index + 1) * row
            shape = shape[1:] if of is None else [shape[0] // n, *shape[1:]]
        buf = torch.empty(end - start, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as fh:
            fh.seek(base + start)
            got = fh.readinto(memoryview(buf.numpy()))
        if got != end - start:
            raise ColibriError(f"{path} is truncated (tensor {name})")
        return buf.view(dtype).view(shape)  # sizes checked at open (_entries)


class SplitRows:
    """A safetensors folder in which some fused tensors read as their row blocks, each under a name of its own
    (a family's `source_view`: DBRX's Wqkv as q/k/v_proj, Granite's shared input_linear as gate/up_proj); the
    fused tensors themselves are hidden. `split`: {block's name: (fused tensor's name, first row, end row)}."""

    def __init__(self, st, split: dict[str, tuple[str, int, int]]):
        self.st, self.split = st, split

    def __getattr__(self, attr):  # folder and the like: as stored
        return getattr(self.st, attr)

    def names(self) -> list[str]:
        fused = {src for src, _, _ in self.split.values()}
        return [n for n in self.st.names() if n not in fused] + list(self.split)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.split:
            src, a, b = self.split[name]
            return (b - a, *self.st.shape(src)[1:])
        return self.st.shape(name)

    def dtype(self, name: str) -> str:
        return self.st.dtype(self.split[name][0] if name in self.split else name)

    def nbytes(self, name: str) -> int:
        if name in self.split:
            src, a, b = self.split[name]
            return self.st.nbytes(src) * (b - a) // max(self.st.shape(src)[0], 1)
        return self.st.nbytes(name)

    def read(self, name: str, index: int | None = None, of: int | None = None) -> torch.Tensor:
        if name not in self.split:
            return self.st.read(name, index, of) if of is not None else self.st.read(name, index)
        src, a, b = self.split[name]
        rows = self.st.shape(src)[0]
        if b > rows:
            raise ColibriError(f"{src} has {rows} rows; the config implies at least {b}")
        return self.st.read(src)[a:b]
