"""Weight quantization: canonical on-disk layouts and the `QLinear` module that runs them.

A linear weight of logical shape [out, in] is stored as a small dict of tensors keyed by
name suffix ("" for the main data, ".scale", ".min"). The layouts are *canonical*: plain,
documented byte layouts that any reader can decode, never a torch-internal packing (those
change between torch versions and CPU ISAs). `QLinear` repacks into a kernel's private
format at construction when that makes the matmul faster.

Schemes (see docs/DESIGN.md and docs/FORMAT.md):
- ``f32`` / ``f16`` / ``bf16``: the weight itself.
- ``int8``: symmetric per output channel. ``""`` int8 [out, in], ``.scale`` f32 [out];
  w = q * scale[:, None].
- ``int4``: asymmetric, group-wise along ``in`` (group g). ``""`` uint8 [out, in // 2] with the
  even column in the low nibble and the odd column in the high nibble (values 0..15);
  ``.scale`` f16 [out, in // g]; ``.min`` f16 [out, in // g]; w = q * scale + min.
- ``int2`` (EXPERIMENTAL): as int4 but 4 values per byte, column 4k + j in bits 2j..2j+1
  (lowest bits = lowest column); ``""`` uint8 [out, in // 4], values 0..3.
- ``int3`` (EXPERIMENTAL): 8 values in 3 bytes. Columns 8k..8k+7 form one little-endian
  24-bit word (byte 3k is bits 0..7), column 8k + j in bits 3j..3j+2; ``""`` uint8
  [out, in * 3 // 8], values 0..7.
int2/int3 have no fused kernel: QLinear dequantizes them on every forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .convert.quant_grid import on_grid
from .kernels import native

SCHEMES = ("f32", "f16", "bf16", "int8", "int4", "int2", "int3")
FLOAT_DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Bits per value and values per packing unit (the smallest run of columns that fills whole bytes).
_BITS = {"int4": 4, "int2": 2, "int3": 3}
_PACK = {"int4": 2, "int2": 4, "int3": 8}
KERNELS = ("auto", "native", "fused", "dequant")

# Quantize at most this many elements at a time: the f32 working copy of a large
# tensor (lm_head, embeddings) would otherwise cost 4 bytes per weight of extra peak RAM.
_QUANT_CHUNK_ELEMS = 1 << 24
# The int4 CPU repack needs an int32 [rows, in] temporary; bound it the same way.
_REPACK_CHUNK_ELEMS = 1 << 22
# Dequant path: dequantize at most this many weights at a time (a 4 MiB f32 temporary).
_DEQUANT_CHUNK_ELEMS = 1 << 20
# torch's CPU int4 packing works on 64-row blocks; chunks must be multiples of it to concat.
_INT4_ROW_BLOCK = 64
_INT4_GROUP_SIZES = (32, 64, 128, 256)
# kernel="auto" with the native kernels (colibri/kernels): the largest input row count they take. They
# read each weight row once for all rows, so decode batches stay cheap; up to native.MOE_MAX_ROWS so
# that a step small enough for the native MoE runs wholly on the native pool (the engine gives it the
# threads then). At 8-64 rows int8 is on par with torch's int8 kernel (2 threads, AVX-512 EPYC), and
# dequantize-then-GEMM is 2-10x slower.
NATIVE_MAX_ROWS: dict[str, int] = {"int8": 64, "int4": 64}
# In a large prefill step (torch has the threads, the native pool one): the rows up to which the
# one-thread native kernel still beats dequantize-then-GEMM (bench_quant.py, as measured before).
PREFILL_NATIVE_ROWS: dict[str, int] = {"int8": 8, "int4": 32}
# Alignment of a module's own buffers once moved into memory its caller owns (an expert-cache slot).
OWNED_ALIGN = 64
# kernel="auto": the largest input row count for which the fused CPU kernel beats
# dequantize-then-GEMM, measured with benchmarks/bench_quant.py (2 threads, AVX-512 EPYC,
# torch 2.13). The fused kernels are weight-only GEMV-style loops: 2-3x faster than bf16
# F.linear for decode, but their time grows linearly with rows while oneDNN's GEMM barely
# does. In f32 only int8 at one row is (marginally) ahead, and f16 lacks a vector path on
# CPUs without AVX512-FP16 (10x slower), so both are left out. Missing key = never fused.
# Re-measure on other CPUs (AMX, AVX512-FP16); this dict is the knob.
FUSED_MAX_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("int8", torch.bfloat16): 12,
    ("int8", torch.float32): 1,
    ("int4", torch.bfloat16): 64,
}


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {SCHEMES}")


def can_quantize(shape: tuple[int, ...] | torch.Size, scheme: str, group_size: int = 64) -> bool:
    """Whether `quantize` accepts a weight of this shape (the converter falls back to int8 if not)."""
    _check_scheme(scheme)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        return False
    if scheme in FLOAT_DTYPES or scheme == "int8":
        return True
    n_in = shape[1]
    return group_size > 0 and n_in % group_size == 0 and n_in % _PACK[scheme] == 0


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def layout(shape: tuple[int, int], scheme: str, group_size: int = 64) -> Layout:
    """Canonical tensors of a quantized weight: suffix -> (shape, dtype). Raises if not quantizable."""
    _check_scheme(scheme)
    if not can_quantize(shape, scheme, group_size):
        raise ValueError(_shape_error(shape, scheme, group_size))
    out, n_in = int(shape[0]), int(shape[1])
    if scheme in FLOAT_DTYPES:
        return {"": ((out, n_in), FLOAT_DTYPES[scheme])}
    if scheme == "int8":
        return {"": ((out, n_in), torch.int8), ".scale": ((out,), torch.float32)}
    n_groups = n_in // group_size
    return {
        "": ((out, n_in * _BITS[scheme] // 8), torch.uint8),
        ".scale": ((out, n_groups), torch.float16),
        ".min": ((out, n_groups), torch.float16),
    }


def _shape_error(shape: tuple[int, ...] | torch.Size, scheme: str, group_size: int) -> str:
    if len(shape) != 2:
        return f"{scheme}: expected a 2-D [out, in] weight, got shape {tuple(shape)}"
    return (
        f"{scheme}: in_features={shape[1]} must be a multiple of group_size={group_size} "
        f"(and of {_PACK.get(scheme, 1)} for byte packing); use can_quantize() and fall back to int8"
    )


# ----------------------------------------------------------------------------- bit packing


def _pack(q: Tensor, scheme: str) -> Tensor:
    """q uint8 [out, in] (values < 2**bits) -> canonical packed uint8 [out, in * bits // 8]."""
    out, n_in = q.shape
    if scheme == "int4":
        return q[:, 0::2] | (q[:, 1::2] << 4)
    if scheme == "int2":
        q4 = q.view(out, n_in // 4, 4)
        return (q4[..., 0] | (q4[..., 1] << 2) | (q4[..., 2] << 4) | (q4[..., 3] << 6)).contiguous()
    q8 = q.view(out, n_in // 8, 8).to(torch.int32)
    word = q8[..., 0]  # [out, in // 8], 24 bits used
    for j in range(1, 8):
        word = word | (q8[..., j] << (3 * j))
    packed = torch.stack((word & 0xFF, (word >> 8) & 0xFF, word >> 16), dim=-1)  # [out, in // 8, 3]
    return packed.to(torch.uint8).view(out, n_in * 3 // 8)


def _unpack(data: Tensor, scheme: str, n_in: int) -> Tensor:
    """Canonical packed uint8 [out, in * bits // 8] -> uint8 [out, in]. Never writes into `data`."""
    out = data.shape[0]
    if scheme == "int4":
        return torch.stack((data & 0xF, data >> 4), dim=-1).view(out, n_in)
    if scheme == "int2":
        return torch.stack([(data >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1).view(out, n_in)
    b = data.reshape(out, n_in // 8, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [out, in // 8]
    return torch.stack([(word >> (3 * j)) & 0x7 for j in range(8)], dim=-1).to(torch.uint8).view(out, n_in)


# ----------------------------------------------------------------------------- quantize / dequantize


def _quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    wf = w.float()
    scale = wf.abs().amax(dim=1) / 127.0  # [out]
    if not torch.isfinite(scale).all():
        raise ValueError("int8: weight has non-finite values")
    # All-zero rows: any divisor works (q = 0); avoid 0/0.
    q = torch.round(wf / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


def _quantize_group(w: Tensor, scheme: str, group_size: int, grid: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    out, n_in = w.shape
    qmax = (1 << _BITS[scheme]) - 1
    wg = w.float().view(out, n_in // group_size, group_size)  # [out, G, g]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, G]
    # Round scale/min to their stored f16 first, so that q is chosen against the values the
    # reader will actually use (keeps |w - deq| <= scale / 2 after storage).
    mn = lo.to(torch.float16)
    scale = ((hi - lo) / qmax).to(torch.float16)
    s32 = scale.float()
    if not (torch.isfinite(s32).all() and torch.isfinite(mn).all()):
        raise ValueError(f"{scheme}: weight has non-finite values or exceeds the f16 range of scale/min")
    safe = torch.where(s32 > 0, s32, 1.0)  # constant group (or f16 underflow): q = 0, w = min
    q = torch.round((wg - mn.float()[..., None]) / safe[..., None]).clamp_(0, qmax)
    q = torch.where(s32[..., None] > 0, q, 0.0)
    if grid:
        q, scale = on_grid(wg, mn, q, scale, qmax)
    return _pack(q.to(torch.uint8).view(out, n_in), scheme), scale, mn


def quantize(w: Tensor, scheme: str, group_size: int = 64, grid: bool = False) -> dict[str, Tensor]:
    """Quantize a [out, in] weight (any float dtype) into its canonical tensors, keyed by suffix.

    Float schemes return {"": w cast} (w itself when the dtype already matches). int2/int3
    are EXPERIMENTAL. Raises ValueError if the shape does not fit the scheme (see can_quantize).
    `grid`: the weight comes from a quantized checkpoint: a group already on a grid of the scheme's
    levels is stored exactly (quant_grid.py; it costs a sort per group, ~4x the time).
    """
    _check_scheme(scheme)
    if not w.is_floating_point():
        raise ValueError(f"quantize expects a float weight, got {w.dtype}")
    if not can_quantize(w.shape, scheme, group_size):
        raise ValueError(_shape_error(w.shape, scheme, group_size))
    if scheme in FLOAT_DTYPES:
        return {"": w.to(FLOAT_DTYPES[scheme])}
    out, n_in = w.shape
    rows = max(1, _QUANT_CHUNK_ELEMS // n_in)
    parts = []
    for r in range(0, out, rows):
        chunk = w[r : r + rows]
        if scheme == "int8":
            parts.append(_quantize_int8(chunk))
        else:
            parts.append(_quantize_group(chunk, scheme, group_size, grid))
    if scheme == "int8":
        return {"": torch.cat([p[0] for p in parts]), ".scale": torch.cat([p[1] for p in parts])}
    return {
        "": torch.cat([p[0] for p in parts]),
        ".scale": torch.cat([p[1] for p in parts]),
        ".min": torch.cat([p[2] for p in parts]),
    }


def _check_tensors(tensors: dict[str, Tensor], scheme: str, shape: tuple[int, int], group_size: int) -> None:
    for suffix, (shp, dt) in layout(shape, scheme, group_size).items():
        t = tensors.get(suffix)
        if t is None:
            raise ValueError(f"{scheme} weight {tuple(shape)}: missing tensor {suffix!r}")
        if tuple(t.shape) != shp or t.dtype != dt:
            raise ValueError(
                f"{scheme} weight {tuple(shape)}: tensor {suffix!r} is {t.dtype} {tuple(t.shape)}, "
                f"expected {dt} {shp}"
            )


def _dequant_group(tensors: dict[str, Tensor], scheme: str, shape: tuple[int, int], group_size: int,
                   dtype: torch.dtype) -> Tensor:
    out, n_in = shape
    q = _unpack(tensors[""], scheme, n_in).view(out, n_in // group_size, group_size)  # [out, G, g]
    # f32 math then one cast: measured faster on CPU than broadcasting bf16 ops (which also
    # round twice), and in-place ops are safe because q is a fresh tensor.
    w = q.float().mul_(tensors[".scale"].float()[..., None]).add_(tensors[".min"].float()[..., None])
    return w.view(out, n_in).to(dtype)


def dequantize(tensors: dict[str, Tensor], scheme: str, shape: tuple[int, int], group_size: int = 64,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """Canonical tensors -> dense [out, in] weight in `dtype` (arithmetic in f32, then cast).

    For a float scheme whose dtype equals `dtype` the stored tensor itself is returned (no copy).
    """
    shape = (int(shape[0]), int(shape[1]))
    _check_tensors(tensors, scheme, shape, group_size)
    if scheme in FLOAT_DTYPES:
        return tensors[""].to(dtype)
    if scheme == "int8":
        return (tensors[""].float() * tensors[".scale"].float()[:, None]).to(dtype)
    return _dequant_group(tensors, scheme, shape, group_size, dtype)


# ----------------------------------------------------------------------------- QLinear


def _int8_cpu_fusable(shape: tuple[int, int], compute_dtype: torch.dtype) -> bool:
    # torch 2.13's _weight_int8pack_mm on CPU returns NaN/garbage or segfaults in bf16 when
    # in_features % 16 != 0 (f32 looked fine; we keep one rule for all dtypes).
    return shape[1] % 16 == 0 and compute_dtype in FLOAT_DTYPES.values()


def _int4_cpu_fusable(shape: tuple[int, int], group_size: int, compute_dtype: torch.dtype) -> bool:
    # Constraints of torch's _convert_weight_to_int4pack_for_cpu / _weight_int4pack_mm_for_cpu.
    return shape[0] % 16 == 0 and group_size in _INT4_GROUP_SIZES and compute_dtype in FLOAT_DTYPES.values()


def _native_ok(scheme: str, shape: tuple[int, int], group_size: int, compute_dtype: torch.dtype) -> bool:
    """Whether the native kernels (colibri/kernels/) run this weight: int8 any shape, int4 with
    in % 32 == 0 and g % 32 == 0; activations in f32 or bf16; the library built on this machine."""
    if compute_dtype not in (torch.float32, torch.bfloat16) or scheme not in NATIVE_MAX_ROWS:
        return False
    if scheme == "int4" and (shape[1] % 32 or group_size % 32):
        return False
    return native.available()


def _int4_pack_cpu(data: Tensor, shape: tuple[int, int]) -> Tensor:
    """Canonical int4 [out, in // 2] -> torch's CPU int4 packing (a fresh [out, in // 2] uint8).

    Done in row chunks (multiples of torch's 64-row block, which concatenate exactly) so the
    int32 [rows, in] temporary the converter insists on stays small.
    """
    out, n_in = shape
    rows = max(_INT4_ROW_BLOCK, (_REPACK_CHUNK_ELEMS // n_in) // _INT4_ROW_BLOCK * _INT4_ROW_BLOCK)
    packed = torch.empty(out, n_in // 2, dtype=torch.uint8)
    for r in range(0, out, rows):
        q32 = _unpack(data[r : r + rows], "int4", n_in).to(torch.int32)  # [rows, in]
        packed[r : r + rows] = torch._convert_weight_to_int4pack_for_cpu(q32, 2)
    return packed


def owned_bytes(info: dict, compute_dtype: torch.dtype, device_type: str = "cpu") -> int:
    """Bytes a QLinear over this stored weight allocates beyond the stored tensors (its `nbytes`),
    from the weight's tensor-index entry alone (`dtype`, `nbytes`, optional `quant`).

    Mirrors `QLinear.from_tensors`: the cast of a float weight, the int8 scale cast, and the int4
    repack for the fused CPU kernel. tests/test_tiers.py checks it against `QLinear.nbytes`.
    """
    isz = torch.empty(0, dtype=compute_dtype).element_size()
    q = info.get("quant")
    if q is None:
        # Float linears are cast to the compute dtype; f32 tensors are parameters (norms,
        # routers), which keep their dtype, as do embeddings.
        dt = FLOAT_DTYPES.get(info["dtype"])
        if dt is None or dt in (compute_dtype, torch.float32):
            return 0
        return info["nbytes"] // dt.itemsize * isz
    out, n_in = q["shape"]
    if device_type == "cpu" and _native_ok(q["scheme"], (out, n_in), q["group_size"], compute_dtype):
        return 0  # the native kernels read the canonical tensors as they are
    if q["scheme"] == "int8":
        return 0 if compute_dtype == torch.float32 else out * isz
    if (q["scheme"] == "int4" and device_type == "cpu" and FUSED_MAX_ROWS.get(("int4", compute_dtype), 0) > 0
            and _int4_cpu_fusable((out, n_in), q["group_size"], compute_dtype)):
        return out * n_in // 2 + (n_in // q["group_size"]) * out * 2 * isz  # packed [out, in/2] + [G, out, 2]
    return 0


def bias_bytes(info: dict, compute_dtype: torch.dtype) -> int:
    """Bytes a QLinear allocates for a stored bias (its cast to the compute dtype; 0 if none needed)."""
    dt = FLOAT_DTYPES.get(info["dtype"])
    if dt is None or dt == compute_dtype:
        return 0
    return info["nbytes"] // dt.itemsize * compute_dtype.itemsize


def stored_linear(tensors: dict[str, Tensor], info: dict, bias: Tensor | None,
                  compute_dtype: torch.dtype) -> QLinear:
    """A QLinear over a stored weight: canonical tensors keyed by suffix ("", ".scale", ".min") and
    its tensor-index entry (`quant` for quantized weights; a float weight's scheme is its dtype)."""
    q = info.get("quant")
    if q is None:
        w = tensors[""]
        scheme = next(k for k, v in FLOAT_DTYPES.items() if v == w.dtype)
        return QLinear.from_tensors({"": w}, scheme, tuple(w.shape), 0, bias, compute_dtype)
    return QLinear.from_tensors(tensors, q["scheme"], tuple(q["shape"]), q["group_size"], bias, compute_dtype)


class QLinear(nn.Module):
    """y = x @ W.T (+ bias) for a weight in any scheme; output in `compute_dtype`.

    Build with `from_tensors` (canonical tensors, possibly zero-copy read-only mmap views; they
    are never written) or `from_dense`. `self.path` is fixed at construction:
    - "dense": float schemes, F.linear; the weight is cast once at construction only if its
      dtype differs from compute_dtype (otherwise it is used as is, no copy).
    - "fused": CPU weight-only kernels, used for inputs of at most `fused_max_rows` rows
      (decode); larger inputs (prefill) dequantize, since there a dense GEMM wins.
      int8: torch._weight_int8pack_mm reads the stored int8 directly (only the [out] scale is
      converted to compute_dtype, which that kernel requires). int4:
      torch._weight_int4pack_mm_for_cpu needs torch's private packing, so construction
      ALLOCATES a repacked uint8 [out, in // 2] plus scales_and_zeros [in // g, out, 2] in
      compute_dtype (out * in / 2 * (1 + 8 / g) bytes for bf16; see `nbytes`) and costs a few
      ms per million weights. The canonical tensors stay referenced for the large-input path:
      free when they are mmap views, but a second copy if the caller passed RAM tensors.
    - "dequant": the canonical tensors are dequantized on every forward, a block of output rows
      at a time (CUDA, int2/int3, shapes/group sizes the fused kernels reject, dtypes missing
      from FUSED_MAX_ROWS, or kernel="dequant"). int8 applies the scale to the output instead
      of the weight (same math, one less pass over W).
    `nbytes` counts tensors this module allocated itself; `borrowed_nbytes` those it only
    references (whatever was passed to from_tensors).
    """

    def __init__(self, scheme: str, shape: tuple[int, int], group_size: int, compute_dtype: torch.dtype,
                 path: str, fused_max_rows: int = 0) -> None:
        super().__init__()
        self.scheme = scheme
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.group_size = group_size
        self.compute_dtype = compute_dtype
        self.path = path
        self.fused_max_rows = fused_max_rows
        self._owned: set[str] = set()
        self.native_plain = False  # native path and no bias (set by from_tensors): the fast decode call
        self._fast: tuple | None = None

    def _hold(self, name: str, t: Tensor | None, owned: bool) -> None:
        # Non-persistent buffers: .to(device) moves them, state_dict stays free of packings.
        self.register_buffer(name, t, persistent=False)
        if owned and t is not None:
            self._owned.add(name)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], scheme: str, shape: tuple[int, int], group_size: int,
                     bias: Tensor | None, compute_dtype: torch.dtype, *, kernel: str = "auto") -> QLinear:
        """Build from canonical tensors (see `layout`), placed on the device they are on.

        kernel: "auto" (fused for small inputs where it is measured faster), "fused" (fused for
        every input size; ValueError if there is no fused kernel) or "dequant".
        """
        _check_scheme(scheme)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        shape = (int(shape[0]), int(shape[1]))
        _check_tensors(tensors, scheme, shape, group_size)
        data = tensors[""]
        on_cpu = data.device.type == "cpu"
        fusable = on_cpu and compute_dtype in FLOAT_DTYPES.values() and (
            (scheme == "int8" and _int8_cpu_fusable(shape, compute_dtype))
            or (scheme == "int4" and _int4_cpu_fusable(shape, group_size, compute_dtype)))
        nativable = on_cpu and scheme not in FLOAT_DTYPES and _native_ok(scheme, shape, group_size, compute_dtype) \
            and all(t.is_contiguous() for t in tensors.values())
        max_rows = 0
        if scheme in FLOAT_DTYPES:
            path = "dense"
        elif kernel == "native":
            if not nativable:
                raise ValueError(f"no native kernel for {scheme} {shape} g={group_size} {compute_dtype} on "
                                 f"{data.device.type} ({native.why_unavailable() or 'unsupported shape or dtype'})")
            path, max_rows = "native", native.max_rows()  # larger inputs dequantize (the C kernels' limit)
        elif kernel == "fused":
            if not fusable:
                raise ValueError(f"no fused kernel for {scheme} {shape} g={group_size} {compute_dtype} "
                                 f"on {data.device.type}")
            path, max_rows = "fused", 1 << 62
        elif kernel == "auto" and nativable:
            path, max_rows = "native", NATIVE_MAX_ROWS[scheme]
        elif kernel == "auto" and fusable:
            max_rows = FUSED_MAX_ROWS.get((scheme, compute_dtype), 0)
            path = "fused" if max_rows > 0 else "dequant"
        else:
            path = "dequant"

        m = cls(scheme, shape, group_size, compute_dtype, path, max_rows)
        if bias is not None:
            if tuple(bias.shape) != (shape[0],):
                raise ValueError(f"bias shape {tuple(bias.shape)} != ({shape[0]},)")
            m._hold("bias", bias.to(compute_dtype), owned=bias.dtype != compute_dtype)
        else:
            m._hold("bias", None, owned=False)

        if path == "dense":
            m._hold("weight", data.to(compute_dtype), owned=data.dtype != compute_dtype)
        elif scheme == "int8" and path == "native":
            m._hold("qweight", data, owned=False)  # [out, in] int8
            m._hold("scale", tensors[".scale"], owned=False)  # [out] f32, as stored
        elif scheme == "int8":
            m._hold("qweight", data, owned=False)  # [out, in] int8, used as is by both paths
            scale = tensors[".scale"]
            # The fused kernel wants scales in x's dtype; bf16 scales round at 2^-9 relative,
            # on par with the bf16 activations themselves.
            m._hold("scale", scale.to(compute_dtype), owned=compute_dtype != scale.dtype)  # [out]
        else:
            m._hold("qweight", data, owned=False)  # canonical [out, in * bits // 8]
            m._hold("scale", tensors[".scale"], owned=False)  # [out, G] f16
            m._hold("min", tensors[".min"], owned=False)
            if path == "fused":  # int4 on CPU
                m._hold("packed", _int4_pack_cpu(data, shape), owned=True)  # torch-private [out, in // 2]
                scale = tensors[".scale"].float()  # [out, G]
                # torch dequantizes (q - 8) * scale + zero, ours is q * scale + min.
                zero = tensors[".min"].float() + 8.0 * scale
                sz = torch.stack((scale.t(), zero.t()), dim=-1).to(compute_dtype).contiguous()  # [G, out, 2]
                m._hold("scales_and_zeros", sz, owned=True)
        m.native_plain = path == "native" and bias is None
        return m

    @classmethod
    def from_dense(cls, w: Tensor, scheme: str, group_size: int = 64, bias: Tensor | None = None,
                   compute_dtype: torch.dtype = torch.float32, *, kernel: str = "auto") -> QLinear:
        """quantize(w) then from_tensors -- convenience for tests and tools."""
        tensors = quantize(w, scheme, group_size)
        shape = (int(w.shape[0]), int(w.shape[1]))
        return cls.from_tensors(tensors, scheme, shape, group_size, bias, compute_dtype, kernel=kernel)

    @property
    def nbytes(self) -> int:
        """Bytes of tensors this module allocated itself (repacks, dtype conversions)."""
        return sum(t.numel() * t.element_size() for n, t in self.named_buffers(recurse=False)
                   if n in self._owned)

    @property
    def borrowed_nbytes(self) -> int:
        """Bytes of tensors held by reference (e.g. views into the container's mmap)."""
        return sum(t.numel() * t.element_size() for n, t in self.named_buffers(recurse=False)
                   if n not in self._owned)

    def move_owned(self, tail: Tensor, pos: int = 0) -> int:
        """Move the buffers this module allocated (casts, the int4 repack) into `tail`, 1-D uint8
        memory the caller owns, from byte `pos` (each OWNED_ALIGN-aligned); returns the next free
        byte. A cached expert then lives wholly in its slot, so refills never grow the heap."""
        for name in sorted(self._owned):
            t = getattr(self, name)
            n = t.numel() * t.element_size()
            if pos + n > tail.numel():
                raise ValueError(f"move_owned: {name} needs {n} bytes at {pos}, the tail has {tail.numel()}")
            dst = tail[pos : pos + n].view(t.dtype).view(t.shape)
            dst.copy_(t)
            self._buffers[name] = dst
            pos = (pos + n + OWNED_ALIGN - 1) // OWNED_ALIGN * OWNED_ALIGN
        return pos

    def refill(self, tensors: dict[str, Tensor], bias: Tensor | None = None) -> bool:
        """Bring this module up to date after new bytes landed under the canonical tensors it
        borrows (a refilled cache slot: same memory, same layout). `tensors`/`bias` view that memory.

        Casts (int8 scale, bias, float weight) are redone in place (copy_ rounds like .to()); any
        other derived buffer (the int4 repack) is rebuilt by a throwaway QLinear and copied into
        this module's own buffers. False when shapes disagree: the caller then builds a new module.
        """
        casts = {"scale", "bias", "weight"}
        if self._owned <= casts and ("scale" not in self._owned or self.scheme == "int8"):
            src = {"scale": tensors.get(".scale"), "bias": bias, "weight": tensors.get("")}
            for name in self._owned:
                getattr(self, name).copy_(src[name])
            return True
        tmp = QLinear.from_tensors(tensors, self.scheme, (self.out_features, self.in_features), self.group_size,
                                   bias, self.compute_dtype)
        if tmp._owned != self._owned or any(getattr(tmp, n).shape != getattr(self, n).shape for n in self._owned):
            return False
        for name in self._owned:
            getattr(self, name).copy_(getattr(tmp, name))
        return True

    def dequantized_weight(self, rows: slice = slice(None)) -> Tensor:
        """Dense [out, in] weight (or the given output rows of it) in compute_dtype."""
        if self.path == "dense":
            return self.weight[rows]
        if self.scheme == "int8":
            return (self.qweight[rows].to(self.compute_dtype) * self.scale[rows, None]).to(self.compute_dtype)
        if self.path == "native" and self.scheme == "int4":  # one pass instead of five torch ops, same bits
            return native.q4_dequant(self.qweight[rows], self.scale[rows], self.min[rows], self.group_size,
                                     self.compute_dtype)
        tensors = {"": self.qweight[rows], ".scale": self.scale[rows], ".min": self.min[rows]}
        n_rows = tensors[""].shape[0]
        return _dequant_group(tensors, self.scheme, (n_rows, self.in_features), self.group_size, self.compute_dtype)

    def _dequant_matmul(self, x2: Tensor) -> Tensor:  # x2 [T, in] -> [T, out]
        if x2.device.type != "cpu":
            chunk = self.out_features  # GPU: one pass; launches matter more than temporaries
        else:
            # Dequantize a block of output rows at a time: the temporaries stay cache-sized and
            # are recycled by the allocator instead of being fresh page-faulted memory each
            # forward (a whole-weight f32 temp is 4 bytes/weight; faults dominated on our VM).
            chunk = max(16, _DEQUANT_CHUNK_ELEMS // self.in_features)
        parts = []
        for r in range(0, self.out_features, chunk):
            rows = slice(r, r + chunk)
            if self.scheme == "int8":
                # Scale the [T, rows] output rather than the weight: fewer multiplies.
                y = F.linear(x2, self.qweight[rows].to(self.compute_dtype)) * self.scale[rows]
                parts.append(y.to(self.compute_dtype))  # a native module keeps its scale in f32
            else:
                parts.append(F.linear(x2, self.dequantized_weight(rows)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _apply(self, fn, recurse: bool = True):  # .to(device) etc. replace the buffers: re-take the fast view
        out = super()._apply(fn, recurse)
        self._fast = None
        return out

    def _native_call(self, x2: Tensor) -> Tensor:
        """The native kernel on x2 [T, in] contiguous; the tensors come from a plain tuple (a decode
        step calls this ~130 times: nn.Module's buffer lookup is a Python __getattr__ each)."""
        f = self._fast
        if f is None:
            f = self._fast = (self.qweight, self.scale, getattr(self, "min", None))
        if self.scheme == "int8":
            return native.q8_gemm(x2, f[0], f[1])  # [T, out]
        return native.q4_gemm(x2, f[0], f[1], f[2], self.group_size)

    def forward(self, x: Tensor) -> Tensor:  # x [..., in] -> [..., out]
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.native_plain and x.dim() == 2 and 0 < x.shape[0] <= min(self.fused_max_rows, 1):
            return self._native_call(x.contiguous())  # the decode row: nothing else to do
        if self.path == "dense":
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        rows = x2.shape[0]
        # A large prefill step: the engine gave torch the threads and the native pool one (engine/runner.py),
        # so a one-thread native kernel only wins for a few rows.
        torch_owns = self.path == "native" and native.get_threads() == 1 and torch.get_num_threads() > 1
        if torch_owns and self.scheme == "int8" and 1 < rows <= FUSED_MAX_ROWS[("int8", torch.bfloat16)] \
                and self.compute_dtype == torch.bfloat16 \
                and _int8_cpu_fusable((self.out_features, self.in_features), self.compute_dtype):
            # torch's multi-row int8 kernel on its own threads wins for a few rows (an expert's share of a prompt)
            y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scale.to(self.compute_dtype))
        elif self.path == "native" and 0 < rows <= (PREFILL_NATIVE_ROWS[self.scheme] if torch_owns
                                                    else self.fused_max_rows):
            y = self._native_call(x2.contiguous())
        elif self.path == "fused" and 0 < x2.shape[0] <= self.fused_max_rows and x2.device.type == "cpu":
            x2 = x2.contiguous()
            if self.scheme == "int8":
                y = torch._weight_int8pack_mm(x2, self.qweight, self.scale)  # [T, out]
            else:
                y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = self._dequant_matmul(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}, g={self.group_size}, "
                f"path={self.path}, compute={self.compute_dtype}, bias={self.bias is not None}")
