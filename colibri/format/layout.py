"""The byte layout of a `.coli` file (docs/FORMAT.md): magic, alignments, element types. Its own module so the
writer/reader (container.py) and the header checks (validate.py) share it without importing each other."""

from __future__ import annotations

import torch

MAGIC = b"COLIBRI\0"
FORMAT_VERSION = 1
PREAMBLE_SIZE = 4096
ALIGN = 4096  # start of every standalone tensor and every record
MEMBER_ALIGN = 64  # start of every member inside a record (vector loads)

DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i8": torch.int8, "u8": torch.uint8, "i32": torch.int32,
}  # fmt: skip
DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}
