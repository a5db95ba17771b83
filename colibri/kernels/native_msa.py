"""ctypes side of kernels/msa.c's coli_msa_select: MiniMax-M3's kept key blocks for the rows of one call
(colibri/models/minimax_m3_vl_text.py)."""

from __future__ import annotations

import ctypes

import torch

from .declare import declared

_lib = declared({"coli_msa_select": "ipiippiiiip"})


def select(iq: torch.Tensor, keys: list[torch.Tensor], blk: int, topk: int, local: int) -> torch.Tensor:
    """iq f32 [T, Hi, Di] (the rows' indexer queries), keys[t] bf16 [S_t, Di] contiguous (row t's sequence's indexer
    keys up to its own position) -> uint8 [T, Hi, nb] (1: a kept block of `blk` keys), nb the most blocks of a row."""
    T, Hi, Di = iq.shape
    iq = iq.contiguous()
    S = [k.shape[0] for k in keys]
    nb = -(-max(S) // blk)
    keep = torch.empty(T, Hi, nb, dtype=torch.uint8)
    ptrs = (ctypes.c_void_p * T)(*(k.data_ptr() for k in keys))
    lens = (ctypes.c_int * T)(*S)
    rc = _lib().coli_msa_select(T, iq.data_ptr(), Hi, Di, ptrs, lens, blk, topk, local, nb, keep.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_msa_select failed ({rc})")
    return keep
