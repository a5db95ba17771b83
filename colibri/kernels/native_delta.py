"""ctypes side of kernels/delta.c: Gated DeltaNet decode rows (colibri/layers/linear_attn.py)."""

from __future__ import annotations

import ctypes

import torch

from .declare import declared

MAX_DIM = 1024  # head widths delta.c keeps on its stack

_lib = declared({"coli_delta_rows": "iiiiiippppppppfp",
                 "coli_delta_block": "iiiiiiiiiipppfpfppppppfpp"})


def delta_rows(shape: tuple[int, int, int, int, int], parts: tuple[torch.Tensor, ...], conv: list[int],
               ssm: list[int], conv_w: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """coli_delta_rows: shape (nk, nv, dk, dv, K); parts: the rows' qkv, z, b, a (bf16 [T, *], each with unit
    stride along its row); conv / ssm: each row's state pointers (bf16 [C, K-1], f32 [nv, dk, dv]; updated in
    place); the weights f32 contiguous -> the gated-normed output bf16 [T, nv * dv]."""
    nk, nv, dk, dv, K = shape
    T = parts[0].shape[0]
    if any(t.dtype != torch.bfloat16 or t.stride(1) != 1 for t in parts):
        raise ValueError("delta_rows: bf16 parts with unit column stride")
    out = torch.empty(T, nv * dv, dtype=torch.bfloat16)
    ptrs = (ctypes.c_void_p * 4)(*(t.data_ptr() for t in parts))
    strides = (ctypes.c_long * 4)(*(t.stride(0) for t in parts))
    rc = _lib().coli_delta_rows(T, nk, nv, dk, dv, K, ptrs, strides, (ctypes.c_void_p * T)(*conv),
                                (ctypes.c_void_p * T)(*ssm), conv_w.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(),
                                norm_w.data_ptr(), eps, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_delta_rows failed ({rc})")
    return out


def delta_block(shape: tuple[int, int, int, int, int], scheme: int, group: int, n_in: int, w: ctypes.Array,
                h: torch.Tensor,
                in_norm, post_norm, conv: list[int], ssm: list[int], conv_w: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_delta_block: h [T, hidden] bf16 contiguous; w: QW [n_in + 1] (the n_in input projections, out_proj); the
    norms' f32 weights and eps -> (h + the layer's output, the post-attention norm of that), bf16 [T, hidden]."""
    nk, nv, dk, dv, K = shape
    T, hidden = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = _lib().coli_delta_block(T, hidden, nk, nv, dk, dv, K, scheme, group, n_in, w, h.data_ptr(),
                                 in_norm.weight.data_ptr(), in_norm.eps, post_norm.weight.data_ptr(), post_norm.eps,
                                 (ctypes.c_void_p * T)(*conv), (ctypes.c_void_p * T)(*ssm), conv_w.data_ptr(),
                                 A_log.data_ptr(), dt_bias.data_ptr(), norm_w.data_ptr(), eps, h_out.data_ptr(),
                                 x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_delta_block failed ({rc})")
    return h_out, x_out
