"""ctypes side of kernels/moe.c's coli_zero_moe: LongCat-Flash's MoE with zero-computation experts in one call
(colibri/models/longcat_flash.py)."""

from __future__ import annotations

import torch

from . import native
from .declare import declared

_lib = declared({"coli_zero_moe": "piiipiiiiipfppiipppp"})


def zero_moe(tables: native.MoeTables, x: torch.Tensor, router: torch.Tensor, n_routed: int, k: int, norm: bool,
             kind: int, bias: torch.Tensor | None, scale: float,
             intermediate: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x bf16 [T, H] contiguous, a resident layer's `tables`; router f32 [E + Z, H] contiguous (the first
    `n_routed` rows the routed experts') -> (y bf16 [T, H], idx [T, k], weights [T, k] as the experts saw them), or
    None where the tables lack a routed expert."""
    T, H = x.shape
    idx = torch.empty(T, k, dtype=torch.int64)
    wts = torch.empty(T, k, dtype=torch.float32)
    ys = torch.empty(T * k, H, dtype=torch.float32)
    y = torch.empty_like(x)
    rc = _lib().coli_zero_moe(x.data_ptr(), T, H, intermediate, router.data_ptr(), n_routed,
                              router.shape[0] - n_routed, k, int(norm), kind,
                              None if bias is None else bias.data_ptr(), scale, tables.gu, tables.dn,
                              8 if tables.scheme == "int8" else 4, tables.group_size, idx.data_ptr(), wts.data_ptr(),
                              ys.data_ptr(), y.data_ptr())
    if rc == native.COLI_MISS:
        return None
    if rc != 0:
        raise RuntimeError("router: non-finite logits" if rc == -5 else f"coli_zero_moe failed ({rc})")
    return y, idx, wts
