"""Pre-quantized checkpoints read back in float, so the converter quantizes them like any other.

- `fp8` (DeepSeek-V3, Qwen3-FP8): float8 weights with a `weight_scale_inv` per [bo x bi] block.
- `compressed-tensors` (llm-compressor's format: Kimi-K2-Thinking, GLM-4.5-FP8, RedHatAI's
  `quantized.w4a16` / `FP8-dynamic` models): `pack-quantized` symmetric ints (`weight_packed` int32,
  `weight_scale` per output channel or per group of inputs, `weight_shape`; optional `weight_g_idx`) and
  `float-quantized` float8 (`weight` + `weight_scale` per tensor, channel or block). Activation
  quantization (W8A8) is a runtime choice of those engines: only the weights are read, and activations
  stay colibri's.
- `fbgemm_fp8` (Llama-4-Maverick-...-FP8): float8 weights with one f32 scale per output channel, Linear
  weights and Llama 4's fused expert tensors alike.
- `gptq`, `awq`: zero-point ints packed in int32 words (source_packed.py).
The bits, group size and strategy of a compressed-tensors tensor come from its own shapes (one checkpoint
may mix them); its asymmetric ints (`weight_zero_point`) are refused. (gpt-oss's mxfp4 is its family's:
models/gpt_oss.py.)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from ..errors import ColibriError
from .source_packed import PackedInts

FAMILY_OWNED = ("mxfp4",)  # read by a family's own code
CT_FORMATS = ("pack-quantized", "float-quantized")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   name: str = "") -> torch.Tensor:
    """float8 [out, in] times its per-block f32 scale [ceil(out / bo), ceil(in / bi)] -> f32 [out, in]."""
    (out, n_in), (bo, bi) = q.shape, block
    if tuple(scale_inv.shape) != (-(-out // bo), -(-n_in // bi)):
        raise ColibriError(f"{name}: scale_inv shape {tuple(scale_inv.shape)} does not fit a {(out, n_in)} "
                           f"weight in {bo}x{bi} blocks (quantization_config.weight_block_size)")
    s = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :n_in]  # [out, in]
    return q.float() * s


class _Wrapped(ABC):
    """A safetensors folder some of whose tensors read back dequantized; the rest pass through."""

    def __init__(self, st):
        self.st = st

    def __getattr__(self, attr):  # nbytes, folder: as stored
        return getattr(self.st, attr)

    def dtype(self, name: str) -> str:
        return "F32" if self._is_quantized(name) else self.st.dtype(name)

    @abstractmethod
    def _is_quantized(self, name: str) -> bool:
        """Whether `name` reads back dequantized (its dtype is then F32)."""


class _Fp8Scaled(_Wrapped):
    """float8 weights `W`, each with its scale tensor `W` + `suffix` (hidden): `_apply` makes the floats."""

    suffix = ""

    def __init__(self, st):
        super().__init__(st)
        have = set(st.names())
        self.scales = {n.removesuffix(self.suffix): n for n in have
                       if n.endswith(self.suffix) and n.removesuffix(self.suffix) in have}

    def names(self) -> list[str]:
        hidden = set(self.scales.values())
        return [n for n in self.st.names() if n not in hidden]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.st.shape(name)

    def _is_quantized(self, name: str) -> bool:
        return self.st.dtype(name).startswith("F8")

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        t = self.st.read(name, index)
        if t.dtype not in _FP8:
            return t
        if name not in self.scales:
            raise ColibriError(f"{name} is {self.st.dtype(name)} but the checkpoint has no {name}{self.suffix}")
        return self._apply(name, t, self.st.read(self.scales[name], index))

    @abstractmethod
    def _apply(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The f32 weight (or its `index` slice) of float8 `q` and its scale tensor as stored."""


class Fp8Blocks(_Fp8Scaled):
    """FP8 checkpoints (quant_method "fp8") store a weight `W` as F8_E4M3 plus `W_scale_inv` f32
    [ceil(out / bo), ceil(in / bi)] for weight_block_size [bo, bi]: w[i, j] = q[i, j] * scale_inv[i // bo,
    j // bi]. The scale tensors are hidden."""

    suffix = "_scale_inv"

    def __init__(self, st, block: tuple[int, int]):
        super().__init__(st)
        self.block = (int(block[0]), int(block[1]))

    def _apply(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(q, scale, self.block, name)


class Fp8Rows(_Fp8Scaled):
    """quant_method "fbgemm_fp8": float8 `X.weight` [out, in] times `X.weight_scale` f32 [out, 1]; Llama 4's
    fused experts (x @ W: outputs last) `gate_up_proj` [E, H, 2I] times `gate_up_proj_scale` [E, 1, 2I] and
    `down_proj` [E, I, H] times `down_proj_scale` [E, H, 1] -- one scale per output channel either way, which
    fbgemm's quantizer stores as the rows of the transposed weight. The scales are hidden; activation scales
    (`activation_scale_ub`) are a runtime choice of fbgemm's kernels: activations stay colibri's."""

    suffix = "_scale"

    def _apply(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.float()
        shape, s_shape = self.st.shape(name), self.st.shape(self.scales[name])
        if len(shape) == 3 and len(s_shape) == 3 and s_shape[-1] == 1 and shape[-1] != 1:
            s = s.transpose(-1, -2)  # [.., out, 1] of an [.., in, out] weight: down_proj's
        try:
            return q.float() * s
        except RuntimeError:
            raise ColibriError(f"{name}: scale shape {tuple(s_shape)} does not fit a {tuple(shape)} weight "
                               "(fbgemm_fp8: one scale per output channel)") from None


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int32 [rows, ceil(cols * bits / 32)] holding `cols` values of `bits` bits a row, value i at bits
    i*bits.. of the row's little-endian bit stream, stored + 2^(bits-1) -> int8 [rows, cols] signed."""
    rows = packed.shape[0]
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [rows, W] unsigned
    words = torch.cat([words, torch.zeros(rows, 1, dtype=torch.int64)], 1)  # (a value may cross into the next)
    start = torch.arange(cols, dtype=torch.int64) * bits
    w, off = start // 32, start % 32
    two = words[:, w] | (words[:, w + 1] << 32)  # [rows, cols] 64 bits from the value's first word
    vals = (two >> off) & ((1 << bits) - 1)
    return (vals - (1 << (bits - 1))).to(torch.int8)


class CompressedTensors(_Wrapped):
    """quant_method "compressed-tensors": `X.weight_packed` (+ `_scale`, `_shape`, `_g_idx`) reads back as
    `X.weight` f32; float8 `X.weight` times `X.weight_scale`. Scales, shapes, g_idx, activation scales and
    an FP8 KV cache's `k_scale` / `v_scale` (colibri keeps its KV cache in bf16) are hidden."""

    HIDDEN = ("weight_scale", "weight_shape", "weight_g_idx", "input_scale", "weight_global_scale", "k_scale",
              "v_scale")
    integer_grid = True  # (its ints' groups can be stored exactly by a group scheme: quant.quantize(grid=True))

    def __init__(self, st):
        super().__init__(st)
        have = set(st.names())
        if asym := sorted(n for n in have if n.endswith(".weight_zero_point")):
            raise ColibriError(f"{asym[0]}: asymmetric quantized ints (a zero point) are not supported; convert "
                               "from the bf16 checkpoint")
        self.packed = {n.removesuffix("_packed"): n for n in have if n.endswith(".weight_packed")}
        self.base = have

    def names(self) -> list[str]:
        out = []
        for n in self.st.names():
            if n.endswith(".weight_packed"):
                out.append(n.removesuffix("_packed"))
            elif n.rsplit(".", 1)[-1] not in self.HIDDEN:
                out.append(n)
        return out

    def _is_quantized(self, name: str) -> bool:
        return name in self.packed or self.st.dtype(name).startswith("F8")

    def _companion(self, name: str, suffix: str) -> str:
        comp = name.removesuffix(".weight") + "." + suffix
        if comp not in self.base:
            raise ColibriError(f"{name} is quantized but the checkpoint has no {comp}")
        return comp

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return self.st.shape(name)
        return tuple(int(v) for v in self.st.read(self._companion(name, "weight_shape")).reshape(-1).tolist())

    def nbytes(self, name: str) -> int:
        return self.st.nbytes(self.packed.get(name, name))

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        if name in self.packed:
            shape = self.shape(name)
            packed = self.st.read(self.packed[name], index)
            q = self._unpack(name, packed, shape[-1])
        else:
            q = self.st.read(name, index)
            if q.dtype not in _FP8:
                return q
        scale = self.st.read(self._companion(name, "weight_scale"), index).float()
        g_idx = f"{name.removesuffix('.weight')}.weight_g_idx"
        return _scaled(name, q, scale, self.st.read(g_idx, index) if g_idx in self.base else None)

    def _unpack(self, name: str, packed: torch.Tensor, cols: int) -> torch.Tensor:
        if packed.dtype != torch.int32 or packed.dim() not in (2, 3):
            raise ColibriError(f"{self.packed[name]}: {packed.dtype} {tuple(packed.shape)}, want int32 [rows, words]")
        words = packed.shape[-1]
        bits = next((b for b in range(2, 9) if math.ceil(cols * b / 32) == words), None)
        if bits is None:
            raise ColibriError(f"{self.packed[name]}: {words} int32 words a row do not hold {cols} values of 2-8 bits")
        if packed.dim() == 3:  # a fused [E, out, words] tensor read whole
            return torch.stack([unpack_int32(p, bits, cols) for p in packed])
        return unpack_int32(packed, bits, cols)


def _scaled(name: str, q: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor | None) -> torch.Tensor:
    """q [out, in] (ints or float8) times its scale: one (per tensor), [out, 1] (channel), [out, in / g]
    (groups of g inputs, or input j's group g_idx[j]) or [ceil(out / bo), ceil(in / bi)] (blocks)."""
    if q.dim() == 3:
        return torch.stack([_scaled(name, qi, si, g_idx) for qi, si in zip(q, scale)])
    out, n_in = q.shape
    w = q.float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.dim() != 2:
        raise ColibriError(f"{name}: scale shape {tuple(scale.shape)} does not fit a {(out, n_in)} weight")
    if g_idx is not None:
        if tuple(g_idx.shape) != (n_in,) or scale.shape[0] != out:
            raise ColibriError(f"{name}: g_idx {tuple(g_idx.shape)} / scale {tuple(scale.shape)} do not fit "
                               f"{(out, n_in)}")
        return w * scale[:, g_idx.long()]
    if scale.shape[0] == out and n_in % scale.shape[1] == 0:  # channel (1 column) or groups along the input
        return w * scale.repeat_interleave(n_in // scale.shape[1], 1)
    bo, bi = -(-out // scale.shape[0]), -(-n_in // scale.shape[1])  # blocks
    return dequantize_fp8(q, scale, (bo, bi), name)


def _check_compressed(qc: dict) -> None:
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                    if isinstance(g, dict)}
    formats -= {None, "mixed-precision"}  # (the top level of a checkpoint whose groups differ)
    if bad := sorted(f for f in formats if f not in CT_FORMATS):
        raise ColibriError(f"quantization_config format {bad[0]!r} of compressed-tensors is not supported "
                           f"(only {', '.join(CT_FORMATS)}); convert from the bf16 checkpoint")
    for name, g in (qc.get("config_groups") or {}).items():
        w = (g or {}).get("weights") or {}
        if w and w.get("symmetric") is False:
            raise ColibriError(f"quantization_config.config_groups.{name}: asymmetric weights are not supported; "
                               "convert from the bf16 checkpoint")


def dequantizing(st, cfg: dict):
    """`st` itself, or a reader that dequantizes what the config's quantization_config says it holds."""
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if not method or method in FAMILY_OWNED:
        return st
    if method == "fp8":
        return Fp8Blocks(st, qc.get("weight_block_size") or (128, 128))
    if method == "compressed-tensors":
        _check_compressed(qc)
        return CompressedTensors(st)
    if method == "fbgemm_fp8":
        return Fp8Rows(st)
    if method in ("gptq", "awq"):
        return PackedInts(st, qc)
    raise ColibriError(f"quantization_config.quant_method {method!r} is not supported (colibri reads fp8, "
                       "fbgemm_fp8, compressed-tensors pack-quantized / float-quantized, gptq, awq, and gpt-oss's "
                       "mxfp4); "
                       "convert from the bf16 checkpoint")
