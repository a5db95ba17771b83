"""Lazy reader for Hugging Face safetensors shards: headers only on open, each tensor read with pread.

Reading with pread into a fresh buffer (not through mmap) keeps the converter's RSS near the
largest tensor it holds, not the size of the checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
from math import prod
from pathlib import Path

import torch

from .errors import ColibriError

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


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
                if n > os.path.getsize(f):
                    raise ColibriError(f"{f} is not a safetensors file (bad header length)")
                try:
                    header = json.loads(fh.read(n))
                except json.JSONDecodeError as e:
                    raise ColibriError(f"{f}: corrupt safetensors header ({e})") from None
            for name, e in header.items():
                if name != "__metadata__":
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

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor, or its `index`-th slice along dim 0 (one expert of a fused [E, ...] tensor)."""
        path, e, base = self.entries[name]
        if e["dtype"] not in DTYPES:
            raise ColibriError(f"tensor {name} has dtype {e['dtype']}, which colibri cannot convert")
        dtype, shape = DTYPES[e["dtype"]], list(e["shape"])
        start, end = e["data_offsets"]
        if index is not None:
            row = (end - start) // shape[0]
            start, end, shape = start + index * row, start + (index + 1) * row, shape[1:]
        buf = torch.empty(end - start, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as fh:
            fh.seek(base + start)
            got = fh.readinto(memoryview(buf.numpy()))
        if got != end - start:
            raise ColibriError(f"{path} is truncated (tensor {name})")
        assert prod(shape) * dtype.itemsize == end - start
        return buf.view(dtype).view(shape)
