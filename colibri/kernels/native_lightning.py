"""ctypes side of kernels/lightning.c: a MiniMax lightning-attention block's decode rows in one call
(colibri/layers/lightning.py)."""

from __future__ import annotations

import ctypes

import torch

from .declare import declared

MAX_D = 512  # head width lightning.c keeps on its stack (LA_MAX_D)

_lib = declared({"coli_lightning_block": "iiiiiipppfpfffpppfpp"})


def lightning_block(m, scheme: int, group: int, w: ctypes.Array, h: torch.Tensor, in_norm, post_norm, alpha: float,
                    beta: float, ssm: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_lightning_block: h bf16 [T, hidden] contiguous, one decode row per sequence (ssm: each row's f32
    [H, D, D] state, updated in place); w: QW [3] (qkv_proj, output_gate, out_proj); m: the LightningAttention ->
    (alpha x + beta attn(x) with x = in_norm(h), the post norm of that), bf16 [T, hidden]."""
    a = m.a
    T, hidden = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = _lib().coli_lightning_block(T, hidden, a.heads, a.head_dim, scheme, group, w, h.data_ptr(),
                                     in_norm.weight.data_ptr(), in_norm.eps, post_norm.weight.data_ptr(),
                                     post_norm.eps, alpha, beta, (ctypes.c_void_p * len(ssm))(*ssm),
                                     m.slope_flat.data_ptr(), m.norm.weight.data_ptr(), m.norm.eps,
                                     h_out.data_ptr(), x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_lightning_block failed ({rc})")
    return h_out, x_out
