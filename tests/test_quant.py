"""colibri.quant: canonical layouts, round-trip error bounds, QLinear kernel paths."""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from colibri import quant
from colibri.quant import SCHEMES, QLinear, can_quantize, dequantize, layout, quantize

GROUPED = ("int4", "int2", "int3")


def _w(out: int = 64, n_in: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, n_in, generator=g) * 0.05  # [out, in]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_matches_layout(scheme: str) -> None:
    w = _w(32, 128)
    t = quantize(w, scheme, 32)
    want = layout((32, 128), scheme, 32)
    assert set(t) == set(want)
    for suffix, (shape, dtype) in want.items():
        assert tuple(t[suffix].shape) == shape and t[suffix].dtype == dtype, suffix


def test_int4_nibble_order_and_scale_min() -> None:
    # One group of 16 values 0..15 (+ offset): min = 0.5, scale = 1, q = column index.
    w = (torch.arange(16, dtype=torch.float32) + 0.5)[None, :]  # [1, 16]
    t = quantize(w, "int4", 16)
    # Low nibble = even column: byte k holds q[2k] | q[2k+1] << 4.
    assert t[""].tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert t[".scale"].tolist() == [[1.0]] and t[".min"].tolist() == [[0.5]]
    assert torch.equal(dequantize(t, "int4", (1, 16), 16), w)


def test_int4_dequantize_hand_built() -> None:
    # Two groups of 2 columns; q = [[1, 2, 15, 0]] -> bytes 0x21, 0x0F.
    t = {
        "": torch.tensor([[0x21, 0x0F]], dtype=torch.uint8),
        ".scale": torch.tensor([[0.5, 2.0]], dtype=torch.float16),
        ".min": torch.tensor([[-1.0, 3.0]], dtype=torch.float16),
    }
    got = dequantize(t, "int4", (1, 4), 2)
    assert got.tolist() == [[1 * 0.5 - 1, 2 * 0.5 - 1, 15 * 2.0 + 3, 0 * 2.0 + 3]]


def test_int2_packing() -> None:
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0]])  # [1, 8], g=4: min 0, scale 1
    t = quantize(w, "int2", 4)
    # Column 4k + j in bits 2j..2j+1.
    assert t[""].tolist() == [[0b11_10_01_00, 0b00_01_10_11]]
    assert torch.equal(dequantize(t, "int2", (1, 8), 4), w)


def test_int3_packing() -> None:
    w = torch.arange(8, dtype=torch.float32)[None, :]  # [1, 8], g=8: min 0, scale 1, q = j
    t = quantize(w, "int3", 8)
    # 24-bit little-endian word, column j in bits 3j..3j+2: octal digits 7..0 = 0o76543210.
    assert t[""].tolist() == [[0x88, 0xC6, 0xFA]]
    assert 0o76543210 == 0xFAC688
    assert torch.equal(dequantize(t, "int3", (1, 8), 8), w)


def test_int8_layout_and_zero_row() -> None:
    w = torch.tensor([[1.0, -0.5, 0.26], [0.0, 0.0, 0.0]])
    t = quantize(w, "int8")
    assert t[".scale"].dtype == torch.float32
    assert t[".scale"][0].item() == pytest.approx(1 / 127)
    assert t[""].tolist() == [[127, round(-0.5 * 127), round(0.26 * 127)], [0, 0, 0]]
    deq = dequantize(t, "int8", (2, 3))
    assert torch.isfinite(deq).all() and torch.equal(deq[1], torch.zeros(3))


def test_constant_group_is_exact() -> None:
    w = torch.full((2, 64), 0.3)
    w[1, 32:] = -2.0
    for scheme in GROUPED:
        t = quantize(w, scheme, 32)
        assert torch.equal(t[".scale"], torch.zeros(2, 2, dtype=torch.float16))
        assert torch.allclose(dequantize(t, scheme, (2, 64), 32), w.half().float())


# ----------------------------------------------------------------------------- round trips


def test_int8_round_trip_error() -> None:
    w = _w(64, 256)
    t = quantize(w, "int8")
    deq = dequantize(t, "int8", w.shape)
    assert _rel(deq, w) < 0.01
    # Round-to-nearest: each element within half a step of its row's scale.
    assert ((deq - w).abs() <= t[".scale"][:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("scheme,max_rel", [("int4", 0.1), ("int3", 0.2), ("int2", 0.45)])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_grouped_round_trip_error(scheme: str, max_rel: float, src_dtype: torch.dtype) -> None:
    g = 32
    w = _w(48, 256).to(src_dtype)
    t = quantize(w, scheme, g)
    deq = dequantize(t, scheme, w.shape, g)
    err = (deq - w.float()).abs().view(48, -1, g)  # [out, G, g]
    bound = t[".scale"].float()[..., None] / 2  # [out, G, 1]
    assert (err <= bound * (1 + 1e-3) + 1e-6).all()
    assert _rel(deq, w) < max_rel


def test_float_schemes() -> None:
    w = _w()
    for scheme, dt in quant.FLOAT_DTYPES.items():
        t = quantize(w, scheme)
        assert t[""].dtype == dt and torch.equal(t[""], w.to(dt))
    same = quantize(w, "f32")[""]
    assert same.data_ptr() == w.data_ptr()  # no copy when the dtype already matches


def test_quantize_chunking_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _w(50, 128)
    full = {s: quantize(w, s, 32) for s in ("int8", "int4", "int3")}
    monkeypatch.setattr(quant, "_QUANT_CHUNK_ELEMS", 128 * 7)  # 7-row chunks, ragged tail
    for s, want in full.items():
        got = quantize(w, s, 32)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_shape_errors() -> None:
    w = _w(16, 100)  # 100 % 64 != 0
    assert not can_quantize(w.shape, "int4", 64)
    assert can_quantize(w.shape, "int8", 64) and can_quantize(w.shape, "int4", 20)
    assert not can_quantize((16, 20), "int3", 20)  # 20 % 8 != 0: not byte-packable
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize(w, "int4", 64)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(4, 4, 4), "int8")
    with pytest.raises(ValueError, match="unknown"):
        quantize(w, "int5")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.full((2, 64), float("nan")), "int8")
    with pytest.raises(ValueError, match="f16 range"):
        quantize(torch.full((2, 64), 1e6), "int4", 32)
    with pytest.raises(ValueError, match="expected"):
        t = quantize(_w(16, 128), "int4", 64)
        dequantize({**t, ".scale": t[".scale"].float()}, "int4", (16, 128), 64)


# ----------------------------------------------------------------------------- QLinear


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dt,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_fused_matches_dequant_linear(scheme: str, dt: torch.dtype, tol: float) -> None:
    w = _w(64, 256)
    t = quantize(w, scheme, 64)
    fused = QLinear.from_tensors(t, scheme, (64, 256), 64, None, dt, kernel="fused")
    assert fused.path == "fused"
    x = torch.randn(5, 256).to(dt)
    ref = F.linear(x.float(), dequantize(t, scheme, (64, 256), 64))  # f32 reference
    y = fused(x)
    assert y.dtype == dt and y.shape == (5, 64)
    assert _rel(y, ref) < tol
    slow = QLinear.from_tensors(t, scheme, (64, 256), 64, None, dt, kernel="dequant")
    assert slow.path == "dequant" and _rel(slow(x), ref) < tol


def test_int4_fused_zero_point_convention() -> None:
    # torch's kernel computes (q - 8) * scale + zero; a wrong zero shifts every output.
    w = _w(32, 128) + 0.3  # non-centred so min matters
    m = QLinear.from_dense(w, "int4", 32, None, torch.float32, kernel="fused")
    x = torch.randn(3, 128)
    ref = x @ dequantize(quantize(w, "int4", 32), "int4", (32, 128), 32).T
    assert torch.allclose(m(x), ref, rtol=1e-4, atol=1e-4)


def test_int4_repack_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _w(80, 128)  # 80 rows: a 64-row block plus a 16-row tail
    x = torch.randn(2, 128)
    whole = QLinear.from_dense(w, "int4", 32, None, torch.float32, kernel="fused")
    monkeypatch.setattr(quant, "_REPACK_CHUNK_ELEMS", 128)  # forces 64-row chunks
    chunked = QLinear.from_dense(w, "int4", 32, None, torch.float32, kernel="fused")
    assert torch.equal(whole.packed, chunked.packed)
    assert torch.equal(whole(x), chunked(x))


@pytest.mark.parametrize("scheme", ["int8", "int4", "int3", "int2"])
def test_dequant_row_chunking(monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    w = _w(72, 128)
    x = torch.randn(3, 128)
    whole = QLinear.from_dense(w, scheme, 32, None, torch.float32, kernel="dequant")(x)
    monkeypatch.setattr(quant, "_DEQUANT_CHUNK_ELEMS", 128 * 20)  # 20-row blocks, ragged tail
    chunked = QLinear.from_dense(w, scheme, 32, None, torch.float32, kernel="dequant")(x)
    assert chunked.shape == (3, 72)
    assert torch.allclose(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.fixture
def torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel selection as on a machine without the native kernels (no C compiler)."""
    monkeypatch.setattr(quant.native, "available", lambda: False)


@pytest.mark.usefixtures("torch_kernels")
def test_unfusable_int4_falls_back() -> None:
    w = _w(24, 128)  # 24 rows: torch's int4 packing needs out % 16 == 0
    m = QLinear.from_dense(w, "int4", 32, None, torch.bfloat16)
    assert m.path == "dequant" and m.nbytes == 0
    with pytest.raises(ValueError, match="no fused kernel"):
        QLinear.from_dense(w, "int4", 32, None, torch.bfloat16, kernel="fused")
    m16 = QLinear.from_dense(_w(32, 128), "int4", 16, None, torch.bfloat16)  # g=16 unsupported by torch
    assert m16.path == "dequant"


@pytest.mark.usefixtures("torch_kernels")
def test_int8_fused_needs_in_multiple_of_16() -> None:
    # torch's bf16 int8pack kernel returns garbage / segfaults for in % 16 != 0: must not be used.
    w = _w(32, 24)
    m = QLinear.from_dense(w, "int8", 64, None, torch.bfloat16)
    assert m.path == "dequant"
    with pytest.raises(ValueError, match="no fused kernel"):
        QLinear.from_dense(w, "int8", 64, None, torch.bfloat16, kernel="fused")
    x = torch.randn(1, 24, dtype=torch.bfloat16)
    ref = x.float() @ dequantize(quantize(w, "int8"), "int8", (32, 24)).T
    assert _rel(m(x), ref) < 2e-2


@pytest.mark.usefixtures("torch_kernels")
def test_auto_dispatch_by_rows() -> None:
    w = _w(64, 256)
    m = QLinear.from_dense(w, "int4", 64, None, torch.bfloat16)
    assert m.path == "fused" and m.fused_max_rows == quant.FUSED_MAX_ROWS[("int4", torch.bfloat16)]
    ref = QLinear.from_dense(w, "int4", 64, None, torch.bfloat16, kernel="dequant")
    for rows in (1, m.fused_max_rows, m.fused_max_rows + 1):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        assert _rel(m(x), ref(x)) < 2e-2
    assert QLinear.from_dense(w, "int4", 64, None, torch.float32).path == "dequant"  # f32 never fused


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bias_and_3d_input(scheme: str) -> None:
    w, b = _w(32, 64), torch.randn(32)
    dt = torch.bfloat16
    m = QLinear.from_dense(w, scheme, 32, b, dt)
    m0 = QLinear.from_dense(w, scheme, 32, None, dt)
    x = torch.randn(2, 3, 64, dtype=dt)
    y = m(x)
    assert y.shape == (2, 3, 32) and y.dtype == dt
    # Bias is added in compute dtype (dense path: fused into F.linear, so allow a bf16 ulp).
    assert torch.allclose(y.float(), (m0(x) + b.to(dt)).float(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(y.float(), m0(x).float(), rtol=1e-2, atol=1e-2)
    # 3-D equals row-by-row 2-D.
    y2 = m(x.reshape(6, 64)).reshape(2, 3, 32)
    assert torch.equal(y, y2)
    ref = F.linear(x.float(), dequantize(quantize(w, scheme, 32), scheme, (32, 64), 32), b)
    assert _rel(y, ref) < (0.5 if scheme == "int2" else 0.1)


def test_float_qlinear_no_copy_and_nbytes() -> None:
    w = _w(32, 64).to(torch.bfloat16)
    same = QLinear.from_tensors({"": w}, "bf16", (32, 64), 64, None, torch.bfloat16)
    assert same.weight.data_ptr() == w.data_ptr() and same.nbytes == 0
    assert same.borrowed_nbytes == w.numel() * 2
    cast = QLinear.from_tensors({"": w}, "bf16", (32, 64), 64, torch.zeros(32), torch.float32)
    # Only the weight was converted; the f32 bias already matches compute dtype (borrowed).
    assert cast.weight.dtype == torch.float32 and cast.nbytes == 32 * 64 * 4
    assert cast.borrowed_nbytes == 32 * 4
    x = torch.randn(4, 64)
    assert torch.allclose(cast(x), x @ w.float().T, atol=1e-5)


@pytest.mark.usefixtures("torch_kernels")
def test_nbytes_accounting() -> None:
    t = quantize(_w(64, 256), "int4", 64)
    fused = QLinear.from_tensors(t, "int4", (64, 256), 64, None, torch.bfloat16, kernel="fused")
    # Repacked weight [64, 128] uint8 + scales_and_zeros [4, 64, 2] bf16.
    assert fused.nbytes == 64 * 128 + 4 * 64 * 2 * 2
    assert fused.borrowed_nbytes == sum(v.numel() * v.element_size() for v in t.values())
    t8 = quantize(_w(64, 256), "int8")
    m8 = QLinear.from_tensors(t8, "int8", (64, 256), 64, None, torch.bfloat16)
    assert m8.nbytes == 64 * 2 and m8.qweight.data_ptr() == t8[""].data_ptr()  # only the scale is converted


def test_read_only_mmap_views(tmp_path: Path) -> None:
    # The store hands QLinear zero-copy views into a read-only mmap; any write would SIGSEGV.
    w = _w(64, 128)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    for scheme in SCHEMES:
        t = quantize(w, scheme, 32)
        blob = b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for v in t.values())
        path = tmp_path / scheme
        path.write_bytes(blob)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        views, off = {}, 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer"
            for k, v in t.items():
                n = v.numel() * v.element_size()
                views[k] = torch.frombuffer(mm, dtype=v.dtype, count=v.numel(), offset=off).view(v.shape)
                off += n
        b = torch.ones(64)
        for kernel in ("auto", "dequant"):
            m = QLinear.from_tensors(views, scheme, (64, 128), 32, b, torch.bfloat16, kernel=kernel)
            ref = QLinear.from_tensors(t, scheme, (64, 128), 32, b, torch.bfloat16, kernel=kernel)
            assert torch.equal(m(x), ref(x))
        assert torch.equal(dequantize(views, scheme, (64, 128), 32), dequantize(t, scheme, (64, 128), 32))
        del views, m
        mm.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_dequant_path(scheme: str) -> None:
    w, b = _w(64, 128), torch.randn(64)
    t = {k: v.cuda() for k, v in quantize(w, scheme, 32).items()}
    m = QLinear.from_tensors(t, scheme, (64, 128), 32, b.cuda(), torch.bfloat16)
    assert m.path in ("dense", "dequant")
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    t_cpu = quantize(w, scheme, 32)
    cpu = QLinear.from_tensors(t_cpu, scheme, (64, 128), 32, b, torch.bfloat16, kernel="dequant")
    assert _rel(m(x.cuda()).cpu(), cpu(x)) < 2e-2
