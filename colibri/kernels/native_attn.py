"""The attention kernels' and quantized KV rows' Python side (kernels/attn.c, kernels/kvq.c): the row types of a KV
cache, quantizing rows into them, one query row's or a step's rows' attention over cache views, and the fused
attention block. The layers call these; the one-call step (kernels/step.c) runs the same C directly."""

from __future__ import annotations

import ctypes

import torch

from . import native

# A KV cache's row types (common.h COLI_KV_*; kernels/kvq.c): the compute dtype, or blocks of 32 values with an f16
# scale each in 8 or 4 bits. A call's layout is kvt = k_type | v_type << 4.
KV_BF16, KV_Q8_0, KV_Q4_0 = 0, 1, 2


def kv_row_bytes(kv_type: int, D: int, elem_size: int = 2) -> int:
    """Bytes of one (head, position) cache row of D values (common.h coli_kv_row_bytes; elem_size: the compute dtype's,
    for KV_BF16)."""
    nb = D // 32
    return {KV_Q8_0: 2 * nb + D, KV_Q4_0: 2 * nb + D // 2}.get(kv_type, D * elem_size)


def kv_quantize(x: torch.Tensor, kv_type: int) -> torch.Tensor:
    """coli_kv_quantize: rows x [R, D] bf16/f32 (D % 32 == 0) -> uint8 [R, kv_row_bytes] cache rows of kv_type
    (KV_Q8_0 / KV_Q4_0; the layout and rounding in kernels/kvq.c)."""
    x = x.contiguous()
    R, D = x.shape
    rb = kv_row_bytes(kv_type, D)
    out = torch.empty(R, rb, dtype=torch.uint8)
    if native.lib() is None:
        raise RuntimeError(f"native kernels unavailable: {native.why_unavailable()}")
    rc = native.lib().coli_kv_quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), R, D, kv_type, out.data_ptr(), rb)
    if rc != 0:
        raise ValueError(f"coli_kv_quantize: cannot write type {kv_type} rows of {D}")
    return out


def _kv_widths(kvt: int, D: int, Dv: int | None, k: torch.Tensor, v: torch.Tensor, es: int) -> int:
    """Dv, checking that k/v [Hkv, *, row] have the rows kvt says (a quantized type: uint8 rows of kv_row_bytes)."""
    kt, vt = kvt & 15, kvt >> 4
    if Dv is None:
        if vt:
            raise ValueError("quantized values: give Dv")
        Dv = v.shape[2]
    for t, x, width, name in ((kt, k, D, "keys"), (vt, v, Dv, "values")):
        rb = kv_row_bytes(t, width, es)
        if x.stride(2) != 1 or x.shape[2] * x.element_size() != rb or x.stride(1) != x.shape[2]:
            raise ValueError(f"attention: {name} need contiguous rows of {rb} bytes")
        if (x.dtype == torch.uint8) != bool(t):
            raise ValueError(f"attention: {name} of type {t} in {x.dtype}")
    return Dv


def attn_rows(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], S: list[int], scale: float,
              sinks: torch.Tensor | None = None, kvt: int = 0, D: int | None = None,
              Dv: int | None = None) -> torch.Tensor:
    """T query rows at once (what a step's attention calls): q [T, H, D]; row t attends over the first S[t]
    positions of ks[t] [Hkv, *, D] / vs[t] [Hkv, *, Dv] (views of KV caches, one head stride for all) ->
    [T, H * Dv] in q's dtype. Tests compare it with attn_decode row by row. kvt (k_type | v_type << 4, KV_*): a
    quantized side's tensors are uint8 [Hkv, *, kv_row_bytes] views; quantized values need Dv."""
    T, H, Dq = q.shape
    D = Dq if D is None else D
    if D != Dq:
        raise ValueError(f"attn_rows: q has rows of {Dq}, not {D}")
    Hkv = vs[0].shape[0]
    Dv = _kv_widths(kvt, D, Dv, ks[0], vs[0], q.element_size())
    q = q.contiguous()
    out = torch.empty(T, H * Dv, dtype=q.dtype)
    kp = (ctypes.c_void_p * T)(*[k.data_ptr() for k in ks])
    vp = (ctypes.c_void_p * T)(*[v.data_ptr() for v in vs])
    sk = sinks.float().contiguous() if sinks is not None else None
    rc = native.lib().coli_attn_rows(T, q.data_ptr(), int(q.dtype == torch.bfloat16), H, Hkv, D, Dv, kp,
                                     ks[0].stride(0), vp, vs[0].stride(0), (ctypes.c_int * T)(*S), scale,
                                     None if sk is None else sk.data_ptr(), out.data_ptr(), kvt)
    if rc != 0:
        raise RuntimeError(f"coli_attn_rows failed ({rc})")
    return out


def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sinks: torch.Tensor | None = None, kvt: int = 0, D: int | None = None,
                Dv: int | None = None) -> torch.Tensor:
    """One query row's attention: q [H, D], k [Hkv, S, D], v [Hkv, S, Dv] (rows contiguous, any head
    stride: views of a KV cache), all f32 or all bf16; sinks [H] or None -> [1, H * Dv] in q's dtype. kvt as
    attn_rows: a quantized side uint8 [Hkv, S, kv_row_bytes] (head stride in bytes), Dv given for quantized values."""
    H, Dq = q.shape
    D = Dq if D is None else D
    Hkv, S = v.shape[:2]
    Dv = _kv_widths(kvt, D, Dv, k, v, q.element_size())
    if D != Dq or any(x.dtype not in (q.dtype, torch.uint8) for x in (k, v)):
        raise ValueError("attn_decode: keys/values need contiguous rows in q's dtype")
    q = q.contiguous()
    out = torch.empty(1, H * Dv, dtype=q.dtype)
    sk = sinks.float().contiguous() if sinks is not None else None
    rc = native.lib().coli_attn_decode(q.data_ptr(), int(q.dtype == torch.bfloat16), H, Hkv, D, Dv, k.data_ptr(),
                                       k.stride(0), v.data_ptr(), v.stride(0), S, scale,
                                       None if sk is None else sk.data_ptr(), out.data_ptr(), kvt)
    if rc != 0:
        raise RuntimeError(f"coli_attn_decode failed ({rc})")
    return out


def attn_block(layer: ctypes.Structure, h: torch.Tensor, pos: list[int], kc: list[int], vc: list[int], ks: int, vs: int,
               cos: torch.Tensor, sin: torch.Tensor, kvt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_attn_block: layer a native_block.AttnLayer; h [T, hidden] bf16 contiguous; per row its position and its
    sequence's K/V cache base pointers for this layer (head strides ks/vs elements; bytes for a quantized side of
    kvt, whose rows the block writes quantized); cos/sin f32 [T, rot] contiguous ->
    (h + attention(h), the post-attention norm of that), both bf16 [T, hidden]."""
    T = h.shape[0]
    h_out, x_out = torch.empty_like(h), torch.empty_like(h)
    rc = native.lib().coli_attn_block(ctypes.byref(layer), T, h.data_ptr(), (ctypes.c_int * T)(*pos),
                              (ctypes.c_void_p * T)(*kc), (ctypes.c_void_p * T)(*vc), ks, vs, kvt,
                              cos.data_ptr(), sin.data_ptr(), h_out.data_ptr(), x_out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_attn_block failed ({rc})")
    return h_out, x_out
