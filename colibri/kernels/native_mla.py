"""ctypes side of kernels/mla.c: one MLA (DeepSeek) attention layer's constants and its block call."""

from __future__ import annotations

import ctypes

import torch

from . import native


class MlaLayer(ctypes.Structure):
    """coli_mla_layer (common.h): built once per layer by colibri/layers/mla.py's `MLAttention`."""

    _fields_ = [(n, ctypes.c_int) for n in ("hidden", "heads", "q_lora", "kv_lora", "nope", "rope", "vdim",
                                            "scheme", "group")] \
        + [(n, native.QW) for n in ("wq", "wqb", "wkva", "wo")] \
        + [(n, ctypes.c_void_p) for n in ("in_w", "post_w", "qa_w", "kva_w")] \
        + [(n, ctypes.c_float) for n in ("in_eps", "post_eps", "lora_eps")] \
        + [("interleaved", ctypes.c_int), ("scale", ctypes.c_float)] \
        + [("kvb", native.QW), ("kvb_scheme", ctypes.c_int), ("kvb_group", ctypes.c_int)] \
        + [(n, ctypes.c_void_p) for n in ("bqa", "bkva", "bo")] \
        + [("gated", ctypes.c_int), ("wg", native.QW), ("qgate", ctypes.c_int), ("gate_rank", ctypes.c_int)] \
        + [(n, native.QW) for n in ("in_gd", "in_gu", "post_gd", "post_gu")] \
        + [(n, ctypes.c_int) for n in ("gd_scheme", "gd_group", "gu_scheme", "gu_group")]


_declared = False


def _lib() -> ctypes.CDLL:
    global _declared
    lib = native.lib()
    if not _declared:
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.coli_mla_block_sel.argtypes = [p, i, p, p, p, p, p, p, p, p, p]
        lib.coli_mla_block_sel.restype = i
        lib.coli_mla_attn.argtypes = [i, p, i, i, i, p, p, ctypes.c_float, p]
        lib.coli_mla_attn.restype = i
        _declared = True
    return lib


def mla_block(layer: MlaLayer, h: torch.Tensor, pos: list[int], cache: list[int], cos: torch.Tensor,
              sin: torch.Tensor, sel: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_mla_block: h [T, hidden] bf16 contiguous; per row its position and its sequence's latent cache
    base pointer for this layer (bf16 [ctx, R + Dr] contiguous); cos/sin f32 [T, Dr] contiguous; `sel`: per row
    the positions it attends to (int32, ascending, contiguous: DSA's selection) or None for all ->
    (h + attention(h), the post-attention norm of that), both bf16 [T, hidden]."""
    T = h.shape[0]
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    sels = nsel = None
    if sel is not None and any(s is not None for s in sel):
        sels = (ctypes.c_void_p * T)(*[None if s is None else s.data_ptr() for s in sel])
        nsel = (ctypes.c_int * T)(*[0 if s is None else s.numel() for s in sel])
    rc = _lib().coli_mla_block_sel(ctypes.byref(layer), T, h.data_ptr(), (ctypes.c_int * T)(*pos),
                                   (ctypes.c_void_p * T)(*cache), cos.data_ptr(), sin.data_ptr(), sels, nsel,
                                   h_out.data_ptr(), x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mla_block failed ({rc})")
    return h_out, x_out


def mla_attn(q: torch.Tensor, caches: list[torch.Tensor], S: list[int], R: int, scale: float) -> torch.Tensor:
    """coli_mla_attn (the block's attention, for tests): q bf16 [T, H, W]; row t's latent cache caches[t] bf16
    [>= S[t], W] contiguous -> [T, H, R] bf16: softmax(scale q k^T) over the rows, times their first R channels."""
    T, H, W = q.shape
    q, out = q.contiguous(), torch.empty(T, H, R, dtype=torch.bfloat16)
    rc = _lib().coli_mla_attn(T, q.data_ptr(), H, W, R, (ctypes.c_void_p * T)(*[c.data_ptr() for c in caches]),
                              (ctypes.c_int * T)(*S), scale, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mla_attn failed ({rc})")
    return out
