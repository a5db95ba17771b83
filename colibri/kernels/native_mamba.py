"""ctypes side of kernels/mamba.c and mamba1.c: Mamba-2 decode rows (colibri/layers/mamba2.py) and the first
Mamba's convolution and scan steps for decode rows (colibri/layers/mamba1.py)."""

from __future__ import annotations

import ctypes
import weakref

import torch

from . import native
from .declare import declared

MAX_STATE = 1024  # states a group mamba.c keeps on its stack

_lib = declared({"coli_mamba_rows": "iiiiiipppppppppfp",
                 "coli_mamba_block": "iiiiiiiiipppfpfppppppppfpp",
                 "coli_mamba1_conv": "iiippppp",
                 "coli_mamba1_scan": "iiipplplpppppp",
                 "coli_mamba1_rows": "iiiiipppppppppppfpppp",
                 "coli_mamba1_block": "iiiiiipppppfpfpppppppfppppp"})


def _params(m) -> tuple:
    """The mixer's f32 parameters' pointers, in the kernels' order (conv weight, conv bias or NULL, dt_bias, A_log,
    D, norm weight)."""
    bias = getattr(m.conv1d, "bias", None)
    return (m.conv1d.weight.data_ptr(), None if bias is None else bias.data_ptr(), m.dt_bias.data_ptr(),
            m.A_log.data_ptr(), m.D.data_ptr(), m.norm.weight.data_ptr())


def _ptrs(xs: list[int]) -> ctypes.Array:
    return (ctypes.c_void_p * len(xs))(*xs)


def mamba_rows(m, zxbcdt: torch.Tensor, conv: list[int], ssm: list[int]) -> torch.Tensor:
    """coli_mamba_rows: zxbcdt bf16 [T, I + C + H] contiguous (in_proj's output); conv / ssm: each row's state
    pointers (bf16 [C, K-1], f32 [H, P, N]; updated in place); m: the Mamba2Mixer -> its gated-normed output, bf16
    [T, I]."""
    a = m.a
    out = torch.empty(zxbcdt.shape[0], a.inner, dtype=torch.bfloat16)
    rc = _lib().coli_mamba_rows(zxbcdt.shape[0], a.heads, a.head_dim, a.state, a.groups, a.conv_kernel,
                                zxbcdt.data_ptr(), _ptrs(conv), _ptrs(ssm), *_params(m), a.eps, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mamba_rows failed ({rc})")
    return out


def mamba_block(m, scheme: int, group: int, w: ctypes.Array, h: torch.Tensor, in_norm, post_norm, conv: list[int],
                ssm: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_mamba_block: h bf16 [T, hidden] contiguous; w: QW [2] (in_proj, out_proj); the norms' f32 weights and
    eps -> (h + the layer's output, the post-attention norm of that), bf16 [T, hidden]."""
    a = m.a
    T, hidden = h.shape
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = _lib().coli_mamba_block(T, hidden, a.heads, a.head_dim, a.state, a.groups, a.conv_kernel, scheme, group, w,
                                 h.data_ptr(), in_norm.weight.data_ptr(), in_norm.eps, post_norm.weight.data_ptr(),
                                 post_norm.eps, _ptrs(conv), _ptrs(ssm), *_params(m), a.eps, h_out.data_ptr(),
                                 x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mamba_block failed ({rc})")
    return h_out, x_out


def mamba1_conv(xz: torch.Tensor, conv: list[int], w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """coli_mamba1_conv: xz bf16 [T, 2I] contiguous (in_proj's x, z); conv: each row's bf16 [I, K-1] kept inputs
    (moved on); w f32 [I, 1, K], b f32 [I] or None -> u = silu(conv(x)), bf16 [T, I]."""
    T, inner = xz.shape[0], w.shape[0]
    u = torch.empty(T, inner, dtype=torch.bfloat16)
    rc = _lib().coli_mamba1_conv(T, inner, w.shape[-1], xz.data_ptr(), _ptrs(conv), w.data_ptr(),
                                 None if b is None else b.data_ptr(), u.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mamba1_conv failed ({rc})")
    return u


def mamba1_scan(dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, u: torch.Tensor, xz: torch.Tensor,
                ssm: list[int], A: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """coli_mamba1_scan: dt, u bf16 [T, I] contiguous, B, C bf16 [T, N] (unit column stride), xz in_proj's output
    (the gate z its second half); ssm: each row's f32 [I, N] state (moved on); A = -exp(A_log), D f32 ->
    (S C + D u) * silu(z), bf16 [T, I]."""
    T, inner = u.shape
    if any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in (B, C)):
        raise ValueError("mamba1_scan: bf16 B and C with unit column stride")
    y = torch.empty(T, inner, dtype=torch.bfloat16)
    rc = _lib().coli_mamba1_scan(T, inner, A.shape[1], dt.data_ptr(), B.data_ptr(), B.stride(0), C.data_ptr(),
                                 C.stride(0), u.data_ptr(), xz.data_ptr(), _ptrs(ssm), A.data_ptr(), D.data_ptr(),
                                 y.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mamba1_scan failed ({rc})")
    return y


def _qws(projs) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
    """Native QLinears' weight pointers, schemes (8 / 4) and group sizes, as the kernels take them."""
    n = len(projs)
    return ((native.QW * n)(*(native.QW(*native.qw(p)) for p in projs)),
            (ctypes.c_int * n)(*(8 if p.scheme == "int8" else 4 for p in projs)),
            (ctypes.c_int * n)(*(p.group_size for p in projs)))


def _mamba1_params(m) -> tuple:
    """(conv weight, conv bias or NULL, dt/B/C norm weights or NULLs, their eps, dt_proj's bias, A, D)."""
    a, bias = m.a, getattr(m.conv1d, "bias", None)
    norms = (m.dt_layernorm, m.b_layernorm, m.c_layernorm) if a.inner_norms else (None, None, None)
    return (m.conv1d.weight.data_ptr(), None if bias is None else bias.data_ptr(),
            *(None if n is None else n.weight.data_ptr() for n in norms), a.eps,
            m.native_f32("dt_bias").data_ptr(), m.native_f32("A").data_ptr(), m.D.data_ptr())


# per Mamba1Mixer: its projections' weight pointers for the rows / block calls, beside the module, gone with it
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights(m, call: str, projs: tuple) -> tuple:
    kept = _WEIGHTS.setdefault(m, {})
    if call not in kept:
        kept[call] = _qws(projs)
    return kept[call]


def forget(m) -> None:
    """Drop m's weight pointers (its weights moved)."""
    _WEIGHTS.pop(m, None)


def mamba1_rows(m, xz: torch.Tensor, conv: list[int], ssm: list[int]) -> torch.Tensor:
    """coli_mamba1_rows: xz bf16 [T, 2I] contiguous (in_proj's output); conv / ssm: each row's states (moved on); m:
    the Mamba1Mixer, its x_proj and dt_proj native QLinears -> (S C + D u) * silu(z), bf16 [T, I]."""
    a = m.a
    w, sch, grp = _weights(m, "rows", (m.x_proj, m.dt_proj))
    y = torch.empty(xz.shape[0], a.inner, dtype=torch.bfloat16)
    rc = _lib().coli_mamba1_rows(xz.shape[0], a.inner, a.state, a.dt_rank, a.conv_kernel, sch, grp, w, xz.data_ptr(),
                                 _ptrs(conv), _ptrs(ssm), *_mamba1_params(m), y.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mamba1_rows failed ({rc})")
    return y


def mamba1_block(m, h: torch.Tensor, in_norm, post_norm, conv: list[int], ssm: list[int]) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """coli_mamba1_block: h bf16 [T, hidden] contiguous; m's in_proj, x_proj, dt_proj and out_proj native
    QLinears; the norms' f32 weights and eps -> (h + the layer's output, the post-attention norm of that)."""
    a = m.a
    T, hidden = h.shape
    w, sch, grp = _weights(m, "block", (m.in_proj, m.x_proj, m.dt_proj, m.out_proj))
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = _lib().coli_mamba1_block(T, hidden, a.inner, a.state, a.dt_rank, a.conv_kernel, sch, grp, w, h.data_ptr(),
                                  in_norm.weight.data_ptr(), in_norm.eps, post_norm.weight.data_ptr(), post_norm.eps,
                                  _ptrs(conv), _ptrs(ssm), *_mamba1_params(m), h_out.data_ptr(), x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mamba1_block failed ({rc})")
    return h_out, x_out
