"""ctypes side of kernels/kda.c: Kimi Delta Attention decode rows in one call (colibri/layers/kda.py)."""

from __future__ import annotations

import ctypes

import torch

from .declare import declared

MAX_D = 256  # head width kda.c keeps on its stack (KDA_MAX_D)

_lib = declared({"coli_kda_rows": "iiiiippppppppppppffp",
                 "coli_kda_block": "iiiiiiipppfpfppppppffipp"})


def _ptrs(xs: list[int]) -> ctypes.Array:
    return (ctypes.c_void_p * len(xs))(*xs)


def kda_rows(m, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
             gate: torch.Tensor, conv: list[int], ssm: list[int], conv_w: torch.Tensor, seq: bool = False
             ) -> torch.Tensor:
    """coli_kda_rows: q, k, v, f (f_b_proj's output, or f_proj's) bf16 [T, H D], b [T, H], gate [T, H D] (g_b_proj's,
    or g_proj's), all contiguous; conv / ssm: each row's state pointers (bf16 [3 H D, K-1], f32 [H, D, D]; updated in
    place), or with `seq` one sequence's, its T rows consecutive positions; conv_w f32 [3 H D, K] contiguous; m: the
    KimiDeltaAttention -> o_proj's input, bf16 [T, H D]."""
    a = m.a
    out = torch.empty(q.shape[0], a.heads * a.head_dim, dtype=torch.bfloat16)
    rc = _lib().coli_kda_rows(q.shape[0], int(seq), a.heads, a.head_dim, a.conv_kernel, q.data_ptr(), k.data_ptr(),
                              v.data_ptr(), f.data_ptr(), b.data_ptr(), gate.data_ptr(), _ptrs(conv), _ptrs(ssm),
                              conv_w.data_ptr(), m.dt_bias.data_ptr(), m.A_log.data_ptr(), m.o_norm.weight.data_ptr(),
                              m.o_norm.eps, a.lower_bound, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_kda_rows failed ({rc})")
    return out


def kda_block(m, scheme: int, group: int, w: ctypes.Array, h: torch.Tensor, in_norm, post_norm, conv: list[int],
              ssm: list[int], conv_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_kda_block: h bf16 [T, hidden] contiguous, one decode row per sequence; w: QW [9] (q, k, v, b, f_a, g_a,
    f_b, g_b, o_proj), or [7] for full-rank gates (q, k, v, b, f, g, o_proj) -> (h + the layer's output, the
    post-attention norm of that), bf16 [T, hidden]."""
    a = m.a
    T, hidden = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = _lib().coli_kda_block(T, hidden, a.heads, a.head_dim, a.conv_kernel, scheme, group, w, h.data_ptr(),
                               in_norm.weight.data_ptr(), in_norm.eps, post_norm.weight.data_ptr(), post_norm.eps,
                               _ptrs(conv), _ptrs(ssm), conv_w.data_ptr(), m.dt_bias.data_ptr(), m.A_log.data_ptr(),
                               m.o_norm.weight.data_ptr(), m.o_norm.eps, a.lower_bound, int(a.low_rank),
                               h_out.data_ptr(), x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_kda_block failed ({rc})")
    return h_out, x_out
