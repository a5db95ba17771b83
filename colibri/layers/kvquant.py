"""The KV cache's storage types (llama.cpp's `--cache-type-k/-v`): the compute dtype, q8_0 or q4_0 rows.

A quantized cache keeps one byte row per (head, position): the row's f16 block scales first, then its codes.
Blocks are 32 values along the head dimension (so head_dim % 32 == 0):

- q8_0: `[nb f16 scales][D int8]`, 2 nb + D bytes (nb = D / 32). d = f16(amax / 127); q = rint(x / d),
  clamped to [-127, 127]; value q d.
- q4_0: `[nb f16 scales][D / 2 bytes]`, block b's 16 bytes holding element 32 b + j in byte j's low nibble and
  32 b + j + 16 in its high one. m = the block's value of largest magnitude (the first such), d = f16(m / -8);
  code = rint(x / d) + 8 clamped to [0, 15]; value (code - 8) d, so m itself is exact.

Divisions in f32, rint half to even; the native writer (colibri/kernels/kvq.c) gives the same bytes
(tests/test_native_kv.py). Scales first keep a row's codes contiguous for the kernels' vector loads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..errors import ColibriError
from ..kernels import native_attn

BLOCK = 32
F16_MAX = 65504.0


class KVType(enum.IntEnum):
    """A cache's storage; the values are the kernels' COLI_KV_* codes (common.h)."""

    BF16 = 0  # the compute dtype as it is (bf16; f32 on the f32 path): the default, bit for bit the old cache
    Q8_0 = 1
    Q4_0 = 2

    @classmethod
    def parse(cls, name: str | KVType) -> KVType:
        if isinstance(name, KVType):
            return name
        try:
            return cls[str(name).upper()]
        except KeyError:
            raise ColibriError(f"unknown KV cache type {name!r} (choose from {', '.join(NAMES)})") from None

    @property
    def label(self) -> str:
        return self.name.lower()


NAMES = tuple(t.label for t in KVType)


@dataclass(frozen=True)
class KVTypes:
    """The K and the V cache's types (they may differ, as llama.cpp's -ctk / -ctv)."""

    k: KVType = KVType.BF16
    v: KVType = KVType.BF16

    @classmethod
    def of(cls, spec: str | tuple | KVTypes | None) -> KVTypes:
        """"q8_0" (both), ("q8_0", "q4_0") (K, V), a KVTypes, or None (the default)."""
        if spec is None:
            return cls()
        if isinstance(spec, KVTypes):
            return spec
        if isinstance(spec, (tuple, list)):
            k, v = spec
            return cls(KVType.parse(k), KVType.parse(v))
        t = KVType.parse(spec)
        return cls(t, t)

    @property
    def quantized(self) -> bool:
        return self.k != KVType.BF16 or self.v != KVType.BF16

    @property
    def code(self) -> int:
        """The kernels' `kvt`: the K type in the low 4 bits, the V type in the next 4."""
        return int(self.k) | int(self.v) << 4

    def __str__(self) -> str:
        return self.k.label if self.k == self.v else f"K {self.k.label}, V {self.v.label}"


DEFAULT = KVTypes()


def row_bytes(t: KVType, dim: int) -> int:
    """Bytes of one quantized row of `dim` values (the kernels' own count)."""
    return native_attn.kv_row_bytes(int(t), dim)


def check_dim(t: KVType, dim: int, what: str) -> None:
    if t != KVType.BF16 and dim % BLOCK:
        raise ColibriError(f"a {t.label} KV cache needs {what} widths that are a multiple of {BLOCK} "
                           f"(this model's: {dim}); use --cache-type-k/-v bf16")


def refuse_quantized(types: KVTypes, what: str) -> None:
    """A cache that keeps its compute dtype whatever the flags say refuses a quantized type, in one line."""
    if types.quantized:
        raise ColibriError(f"{what} is kept in the compute dtype: --cache-type-k/-v {types} does not apply to this "
                           "model (use bf16)")


def quantize(x: torch.Tensor, t: KVType) -> torch.Tensor:
    """x [..., D] (bf16 or f32) -> uint8 [..., row_bytes(t, D)] (the module docstring's layout)."""
    *lead, D = x.shape
    xb = x.float().reshape(-1, D // BLOCK, BLOCK)  # [R, nb, 32]
    if t == KVType.Q8_0:
        d = (xb.abs().amax(-1) / 127.0).clamp(max=F16_MAX).half()  # [R, nb]
        dq = d.float()[..., None]
        q = torch.where(dq == 0, 0.0, torch.round(xb / dq)).clamp(-127, 127).to(torch.int8)
        codes = q.view(torch.uint8).reshape(-1, D)
    else:
        m = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))[..., 0]  # [R, nb]: the signed extreme
        d = (m / -8.0).clamp(-F16_MAX, F16_MAX).half()
        dq = d.float()[..., None]
        c = torch.where(dq == 0, 8.0, torch.round(xb / dq) + 8).clamp(0, 15).to(torch.uint8)  # [R, nb, 32]
        codes = (c[..., :16] | (c[..., 16:] << 4)).reshape(-1, D // 2)
    scales = d.contiguous().view(torch.uint8)  # [R, 2 nb]
    return torch.cat((scales, codes), -1).reshape(*lead, -1)


def dequantize(rows: torch.Tensor, t: KVType, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., row_bytes] -> [..., dim] in `dtype` (the values q d in f32, rounded once)."""
    *lead, n = rows.shape
    nb = dim // BLOCK
    r = rows.reshape(-1, n)
    d = r[:, : 2 * nb].contiguous().view(torch.float16).float()[..., None]  # [R, nb, 1]
    codes = r[:, 2 * nb:]
    if t == KVType.Q8_0:
        q = codes.contiguous().view(torch.int8).float().view(-1, nb, BLOCK)
    else:
        c = codes.reshape(-1, nb, BLOCK // 2)
        q = torch.cat((c & 15, c >> 4), -1).float() - 8  # [R, nb, 32]
    return (q * d).reshape(*lead, dim).to(dtype)
