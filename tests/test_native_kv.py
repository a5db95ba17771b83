"""KV caches in 8 and 4 bits (kernels/kvq.c): the quantizer against a torch transcription of its spec, bit for bit;
attention over quantized keys and values against torch over the dequantized cache; the fused block writing its rows
quantized."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from colibri.kernels import native, native_attn
from colibri.kernels.native_attn import KV_BF16, KV_Q4_0, KV_Q8_0

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")

TYPES = (KV_BF16, KV_Q8_0, KV_Q4_0)


def _quantize(x: torch.Tensor, kv_type: int) -> torch.Tensor:
    """The row layout and rounding of kernels/kvq.c in torch: x [R, D] -> uint8 [R, row bytes]."""
    R, D = x.shape
    nb = D // 32
    xf = x.float().reshape(R, nb, 32)
    if kv_type == KV_Q8_0:
        d = (xf.abs().amax(-1) / 127).clamp(max=65504).half()  # [R, nb], f16 rounded to nearest even
        dq = d.float()[..., None]
        q = torch.where(dq == 0, torch.zeros_like(xf), torch.round(xf / dq).clamp(-127, 127))
        vals = q.to(torch.int8).view(torch.uint8).reshape(R, D)
    else:
        m = xf.gather(-1, xf.abs().argmax(-1, keepdim=True))[..., 0]  # the first value of largest |x|
        d = (m / -8).clamp(-65504, 65504).half()
        dq = d.float()[..., None]
        codes = torch.where(dq == 0, torch.full_like(xf, 8), (torch.round(xf / dq) + 8).clamp(0, 15)).to(torch.uint8)
        vals = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(R, D // 2)  # byte j: elements j and j + 16
    return torch.cat([d.view(torch.uint8).reshape(R, 2 * nb), vals], 1)


def _dequantize(rows: torch.Tensor, kv_type: int, D: int) -> torch.Tensor:
    """uint8 [..., row bytes] -> f32 [..., D]."""
    lead, nb = rows.shape[:-1], D // 32
    rows = rows.reshape(-1, rows.shape[-1])
    d = rows[:, : 2 * nb].contiguous().view(torch.float16).float()
    if kv_type == KV_Q8_0:
        v = rows[:, 2 * nb :].contiguous().view(torch.int8).float().reshape(-1, nb, 32)
    else:
        b = rows[:, 2 * nb :].reshape(-1, nb, 16)
        v = torch.cat([b & 15, b >> 4], -1).float() - 8
    return (v * d[..., None]).reshape(*lead, D)


def _query_blocks(q: torch.Tensor) -> torch.Tensor:
    """The query as the kernel scores quantized keys with it: int8 blocks of 32, f32 scales amax / 127, dequantized."""
    x = q.float().reshape(*q.shape[:-1], -1, 32)
    d = x.abs().amax(-1, keepdim=True) / 127
    return (torch.where(d == 0, torch.zeros_like(x), torch.round(x / d).clamp(-127, 127)) * d).reshape(q.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [32, 64, 96, 128])
def test_quantizer_gives_the_specs_bytes(dtype: torch.dtype, D: int) -> None:
    g = torch.Generator().manual_seed(D)
    x = torch.randn(400, D, generator=g) * torch.exp(torch.randn(400, 1, generator=g) * 8)  # 1e-30 .. 1e30 rows
    x[0] = 0
    x[1, :32] = 0  # a zero block beside a live one
    x[2] = 3e38  # past f16: the scale clamps at 65504
    x[3] = -1e-30  # a scale that rounds to 0 in f16
    x[4, ::3] = 1e-40  # f32 subnormals (bf16 keeps some)
    x[5] = torch.arange(D) % 17 - 8.5  # ties at d = 8.5 / 127 and 1.0625 (q4: max -8.5 -> d 1.0625)
    x[6] = (torch.arange(D) % 255 - 127) + 0.5  # d = 1: q8's ties at every value
    x[7] = torch.arange(D) % 16 - 8.0  # q4: d = 1, exact codes; m the first -8
    x[8] = 1e-5 * (torch.arange(D) % 9 - 4)  # subnormal f16 scales
    x = x.to(dtype)
    for t in (KV_Q8_0, KV_Q4_0):
        got = native_attn.kv_quantize(x, t)
        assert got.shape == (400, native_attn.kv_row_bytes(t, D)) and got.dtype == torch.uint8
        assert torch.equal(got, _quantize(x, t)), t
    # the round trip of blocks with normal f16 scales: within half a step (and a little of the scale's rounding); q4_0
    # clamps values of the other sign than the block's largest at 7 steps, up to a step short
    xf = x.float()[:, :32]
    amax = xf.abs().amax(-1, keepdim=True)
    xf = xf[((amax > 1e-2) & (amax < 1e4))[:, 0]]
    for t, bound in ((KV_Q8_0, 0.51 / 127), (KV_Q4_0, 1.01 / 8)):
        back = _dequantize(native_attn.kv_quantize(xf, t), t, 32)
        assert ((back - xf).abs() <= xf.abs().amax(-1, keepdim=True) * bound).all(), t


def _portable() -> ctypes.c_int:
    return ctypes.c_int.in_dll(native.lib(), "coli_kvq_portable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,Dv", [(64, 64), (96, 160), (128, 32)])  # a lone last block; 2..10 value accumulators
def test_attention_over_quantized_caches(dtype: torch.dtype, D: int, Dv: int) -> None:
    """Every (K type, V type), GQA, sinks, windows by pointer offset, S from 1 to 1000. Against torch (f64) over the
    dequantized cache with the query as the kernel quantizes it for quantized keys (int8 blocks, f32 scales): f32
    rounding only (2e-5 of the output's max in f32; bf16: its rounding, 8e-3). Against the unquantized query the
    query's own rounding shows too (2.5e-2 measured <= 1.6e-2). The portable loops give the vector paths' bits."""
    g = torch.Generator().manual_seed(D + Dv)
    H, Hkv = 8, 2
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    port = _portable()
    for S in (1, 15, 16, 17, 1000):
        ctx, lo = S + 9, 3 if S > 1 else 0  # a cache longer than the window, which starts at lo
        k = torch.randn(Hkv, ctx, D, generator=g).to(dtype)
        v = torch.randn(Hkv, ctx, Dv, generator=g).to(dtype)
        q = torch.randn(H, D, generator=g).to(dtype)
        sinks = torch.randn(H, generator=g) if S != 16 else None
        for kt in TYPES:
            for vt in TYPES:
                kc = native_attn.kv_quantize(k.reshape(-1, D), kt).view(Hkv, ctx, -1) if kt else k
                vc = native_attn.kv_quantize(v.reshape(-1, Dv), vt).view(Hkv, ctx, -1) if vt else v
                kd = _dequantize(kc, kt, D) if kt else k.float()
                vd = _dequantize(vc, vt, Dv) if vt else v.float()
                kvt = kt | vt << 4
                out = native_attn.attn_decode(q, kc[:, lo : lo + S], vc[:, lo : lo + S], 0.125, sinks, kvt=kvt, Dv=Dv)
                rows = native_attn.attn_rows(q[None], [kc[:, lo:]], [vc[:, lo:]], [S], 0.125, sinks, kvt=kvt, D=D,
                                             Dv=Dv)
                assert torch.equal(out, rows)
                if kvt:
                    port.value = 1
                    try:
                        again = native_attn.attn_decode(q, kc[:, lo : lo + S], vc[:, lo : lo + S], 0.125, sinks,
                                                        kvt=kvt, Dv=Dv)
                        assert torch.equal(out, again), (S, kt, vt)
                    finally:
                        port.value = 0
                kf = kd[:, lo : lo + S].double().repeat_interleave(H // Hkv, 0)
                vf = vd[:, lo : lo + S].double().repeat_interleave(H // Hkv, 0)
                for qr, bound in ((_query_blocks(q) if kt else q.float(), tol), (q.float(), 2.5e-2 if kt else tol)):
                    sc = (qr.double()[:, None] @ kf.transpose(1, 2))[:, 0] * 0.125  # [H, S]
                    sk = sinks.double()[:, None] if sinks is not None else torch.full((H, 1), -math.inf).double()
                    p = torch.softmax(torch.cat([sc, sk], 1), 1)[:, :S]
                    ref = (p[:, None] @ vf)[:, 0].reshape(1, -1)
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    assert err < bound, (S, kt, vt, bound, err)


@pytest.mark.parametrize("D,Dv,kt,vt,dtype", [(64, 64, KV_Q8_0, KV_Q4_0, torch.bfloat16),
                                              (128, 128, KV_Q4_0, KV_Q8_0, torch.float32),
                                              (96, 96, KV_Q8_0, KV_Q8_0, torch.bfloat16)])
def test_chunk_rows_over_quantized_caches_give_each_rows_own_bits(D: int, Dv: int, kt: int, vt: int,
                                                                 dtype: torch.dtype) -> None:
    """A prompt chunk's rows over one quantized cache share passes over it (KVQ_RB at a time): each row's output is its
    own one-row call's; a row of another sequence in the same call takes the one-row path."""
    g = torch.Generator().manual_seed(D + kt)
    H, Hkv, T, ctx = 8, 2, 11, 80
    k, k2 = (native_attn.kv_quantize(torch.randn(Hkv * ctx, D, generator=g), kt).view(Hkv, ctx, -1) for _ in range(2))
    v, v2 = (native_attn.kv_quantize(torch.randn(Hkv * ctx, Dv, generator=g), vt).view(Hkv, ctx, -1) for _ in range(2))
    q = torch.randn(T, H, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g) if dtype == torch.float32 else None
    S = [40 + t for t in range(T - 1)] + [11]
    ks, vs = [k] * (T - 1) + [k2], [v] * (T - 1) + [v2]
    kvt = kt | vt << 4
    out = native_attn.attn_rows(q, ks, vs, S, 0.125, sinks, kvt=kvt, Dv=Dv)
    for t in range(T):
        one = native_attn.attn_decode(q[t], ks[t][:, : S[t]], vs[t][:, : S[t]], 0.125, sinks, kvt=kvt, Dv=Dv)
        assert torch.equal(out[t], one[0]), t


def _layer(hidden: int, heads: int, kv_heads: int, D: int, window: int, g: torch.Generator):
    """A plain attention layer's native constants (int8 projections, RMSNorms, full rotary) and the tensors they point
    into."""
    from colibri.kernels.native_block import AttnLayer
    from colibri.quant import quantize

    keep = []

    def w(out: int, inp: int) -> native.QW:
        t = quantize(torch.randn(out, inp, generator=g) / inp**0.5, "int8")
        keep.extend(t.values())
        return native.QW(t[""].data_ptr(), t[".scale"].data_ptr(), None)

    nin, npost = torch.rand(hidden, generator=g) + 0.5, torch.rand(hidden, generator=g) + 0.5
    keep += [nin, npost]
    layer = AttnLayer(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=D, scheme=8, group=0,
                      wq=w(heads * D, hidden), wk=w(kv_heads * D, hidden), wv=w(kv_heads * D, hidden),
                      wo=w(hidden, heads * D), in_w=nin.data_ptr(), post_w=npost.data_ptr(), in_eps=1e-5,
                      post_eps=1e-5, rot=D, window=window, scale=D**-0.5)
    return layer, keep


def _rope(pos: list[int], rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    ang = torch.tensor(pos).float()[:, None] * inv[None]
    ang = torch.cat([ang, ang], 1)
    return ang.cos().contiguous(), ang.sin().contiguous()


@pytest.mark.parametrize("kvt,window", [(KV_Q8_0 | KV_Q8_0 << 4, 0), (KV_Q4_0 | KV_Q4_0 << 4, 0),
                                        (KV_Q8_0 | KV_Q4_0 << 4, 5), (KV_BF16 | KV_Q8_0 << 4, 0),
                                        (KV_Q4_0 | KV_BF16 << 4, 0)])
def test_block_writes_quantized_rows(kvt: int, window: int) -> None:
    """coli_attn_block with quantized caches writes each row's key and value as kv_quantize makes them of the rows the
    bf16 block writes (the same inputs: a 6-row prompt chunk, then single steps), and its output stays near the bf16
    cache's (the caches' and the query's rounding). A window (5) reads the rows from its start on."""
    g = torch.Generator().manual_seed(kvt + window)
    hidden, heads, kv_heads, D, ctx = 128, 4, 2, 64, 16
    layer, keep = _layer(hidden, heads, kv_heads, D, window, g)
    kt, vt = kvt & 15, kvt >> 4
    bf = [torch.zeros(kv_heads, ctx, D, dtype=torch.bfloat16) for _ in range(2)]
    qc = [torch.zeros(kv_heads, ctx, native_attn.kv_row_bytes(t, D), dtype=torch.uint8) if t else
          torch.zeros(kv_heads, ctx, D, dtype=torch.bfloat16) for t in (kt, vt)]
    steps = [list(range(6))] + [[p] for p in range(6, 11)]
    for pos in steps:
        h = torch.randn(len(pos), hidden, generator=g).bfloat16()
        cos, sin = _rope(pos, D)
        outs = []
        for (kc, vc), lay in ((bf, 0), (qc, kvt)):
            outs.append(native_attn.attn_block(layer, h, pos, [kc.data_ptr()] * len(pos), [vc.data_ptr()] * len(pos),
                                          kc.stride(0), vc.stride(0), cos, sin, kvt=lay))
        (h0, x0), (h1, x1) = outs
        # of the attention's share of h (measured <= 1.7% with 8-bit rows, <= 15% with 4-bit ones) and of the norm
        bound = 0.25 if KV_Q4_0 in (kt, vt) else 0.05
        assert ((h1.float() - h0.float()).abs().max() / (h0.float() - h.float()).abs().max()).item() < bound
        assert ((x1.float() - x0.float()).abs().max() / x0.float().abs().max()).item() < bound / 2
    n = steps[-1][0] + 1
    for t, cache, ref in ((kt, qc[0], bf[0]), (vt, qc[1], bf[1])):
        want = native_attn.kv_quantize(ref[:, :n].reshape(-1, D), t).view(kv_heads, n, -1) if t else ref[:, :n]
        assert torch.equal(cache[:, :n], want), t
        assert not cache[:, n:].any()  # nothing past the last position
    del keep


def test_layouts_the_kernels_refuse() -> None:
    q = torch.randn(4, 48).bfloat16()
    k = torch.randn(2, 5, 48).bfloat16()
    kq = torch.zeros(2, 5, native_attn.kv_row_bytes(KV_Q8_0, 48), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="-3"):  # 48 is no whole number of blocks
        native_attn.attn_decode(q, kq, k, 0.1, kvt=KV_Q8_0)
    with pytest.raises(ValueError):
        native_attn.kv_quantize(k[0], KV_Q8_0)
    with pytest.raises(ValueError):  # quantized values without their width
        native_attn.attn_decode(q[:, :32], k[..., :32], native_attn.kv_quantize(k[0, :, :32], KV_Q8_0)[None], 0.1,
                           kvt=KV_Q8_0 << 4)
