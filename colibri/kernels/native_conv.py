"""ctypes side of kernels/conv.c: LFM2's gated short convolution for decode rows (colibri/models/lfm2_moe.py)."""

from __future__ import annotations

import ctypes

import torch

from .declare import declared

_lib = declared({"coli_conv_rows": "iiippppp",
                 "coli_conv_block": "iiiiipppfpfppppp"})


def _states(ptrs: list[int]) -> ctypes.Array:
    return (ctypes.c_void_p * len(ptrs))(*ptrs)


def conv_rows(bcx: torch.Tensor, states: list[int], w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """coli_conv_rows: bcx bf16 [T, 3H] contiguous (in_proj's B, C, x); states: each row's bf16 [H, K-1] state
    (moved on in place); w f32 [H, 1, K], bias f32 [H] or None -> C * conv(B * x), bf16 [T, H]."""
    T, H, K = bcx.shape[0], w.shape[0], w.shape[-1]
    out = torch.empty(T, H, dtype=torch.bfloat16)
    rc = _lib().coli_conv_rows(T, H, K, bcx.data_ptr(), _states(states), w.data_ptr(),
                               None if bias is None else bias.data_ptr(), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_conv_rows failed ({rc})")
    return out


def conv_block(scheme: int, group: int, w: ctypes.Array, h: torch.Tensor, in_norm, post_norm, states: list[int],
               conv_w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_conv_block: h bf16 [T, H] contiguous; w: QW [2] (in_proj, out_proj); the norms' f32 weights and eps ->
    (h + the layer's output, the post-attention norm of that), bf16 [T, H]."""
    T, H = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = _lib().coli_conv_block(T, H, conv_w.shape[-1], scheme, group, w, h.data_ptr(), in_norm.weight.data_ptr(),
                                in_norm.eps, post_norm.weight.data_ptr(), post_norm.eps, _states(states),
                                conv_w.data_ptr(), None if bias is None else bias.data_ptr(), h_out.data_ptr(),
                                x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_conv_block failed ({rc})")
    return h_out, x_out
