"""Shared building blocks: weight placeholders, RoPE, dense MLP, the decoder block (attention: attention.py;
the norms: norms.py).

Hidden states are 2-D `[T, H]` everywhere: the rows of one step, possibly of several sequences
(layers/batch.py); attention alone splits them per sequence. Placeholders (`Linear`,
`Embedding`) hold no weights: `models.base.bind()` swaps in what the store hands out,
so a model file never decides where or how a weight is stored.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from . import native_mlp
from .batch import LayerKV
from .moe import SparseMoE
from .norms import LayerNorm, NoNorm, RMSNorm, is_rms, rms_norm  # noqa: F401 (all but RMSNorm: re-exported)


class Linear(nn.Module):
    """Shape-only stand-in for a projection; replaced by a `quant.QLinear` at bind time."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.bias = in_features, out_features, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - replaced before use
        raise RuntimeError("Linear placeholder used before the weights were bound")


class Embedding(nn.Module):
    """Token embedding bound to a container tensor (kept in its stored dtype)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight: torch.Tensor | None = None  # [V, H], set at bind time
        self.out_dtype = torch.float32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).to(self.out_dtype)  # [T, H]


def rotate_half_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A q_proj / k_proj weight [heads * D, in] (or bias [heads * D]) with each head's output channels moved
    from interleaved RoPE pairs (0,1),(2,3),... to rotate-half order (evens, then odds): q and k alike, so
    attention is unchanged and the rotate-half RoPE (the native one) applies (ERNIE-4.5, Llama 4)."""
    D = head_dim
    order = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])  # new channel j <- old channel order[j]
    return t.reshape(t.shape[0] // D, D, -1)[:, order].reshape(t.shape)


# ----------------------------------------------------------------------------- RoPE


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """rope_theta from a v4 (top-level) or v5 (`rope_parameters`) config."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", default)))


ROPE_TYPES = ("linear", "llama3", "yarn", "ntk_alpha")  # the scaled RoPE types `rope_inv_freq` implements


def rope_scaling(cfg: dict) -> dict | None:
    """The rope scaling dict, or None for plain RoPE (v4 `rope_scaling` or v5 `rope_parameters`)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "dynamic" and params.get("alpha"):  # Hunyuan's: a fixed alpha, not a length-dependent NTK
        kind = "ntk_alpha"
    return None if kind in (None, "default") else {**params, "rope_type": kind}


def _yarn_find_dim(num_rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, base: float, scaling: dict | None, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim // 2]` and the cos/sin scale for the supported rope types."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv, 1.0
    kind = scaling["rope_type"]
    if kind == "ntk_alpha":  # the base stretched once (transformers' Hunyuan rotary), the frequencies as plain
        return rope_inv_freq(dim, base * float(scaling["alpha"]) ** (dim / (dim - 2)), None, max_pos)
    if kind == "longrope":  # (phimoe's alone) the short factors at every length, as transformers' phimoe
        ext = torch.tensor([float(f) for f in scaling["short_factor"]], dtype=torch.float32)
        if ext.shape[0] != dim // 2:
            raise ValueError(f"longrope short_factor has {ext.shape[0]} entries for {dim // 2} frequencies")
        return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), \
            float(scaling["short_mscale"])
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        old = int(scaling.get("original_max_position_embeddings") or max_pos)
        if scaling.get("factor") is None:  # as transformers: the context extension ratio
            factor = max_pos / old
        beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if scaling.get("attention_factor") is not None:  # an explicit factor wins, as in transformers
            attn = float(scaling["attention_factor"])
        elif mscale and mscale_all:
            attn = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
        else:
            attn = yarn_get_mscale(factor)
        low = _yarn_find_dim(beta_fast, dim, base, old)
        high = _yarn_find_dim(beta_slow, dim, base, old)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        # 1 / (factor * base^(2i/d)), rounded exactly as transformers does (inv / factor differs by an ulp)
        interp = 1.0 / (factor * (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)))
        return interp * (1 - extrap) + inv * extrap, attn
    raise ValueError(f"unsupported rope_type '{kind}' (supported: default, {', '.join(ROPE_TYPES)})")


class RoPE(nn.Module):
    """Rotary embedding over the first `dim` channels of each head, with cos/sin tables cached."""

    def __init__(self, dim: int, base: float, scaling: dict | None = None, max_pos: int = 4096,
                 interleaved: bool = False):
        super().__init__()
        inv, self.mscale = rope_inv_freq(dim, base, scaling, max_pos)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.dim, self.interleaved = dim, interleaved
        # (dtype, device) -> (cos, sin) [n, d]
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def all_rows(self, end: int, dtype: torch.dtype, device: torch.device | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached cos/sin tables [n, d] in `dtype` on `device` (default CPU), n >= end (grown by doubling)."""
        device = device or torch.device("cpu")
        cos, sin = self._tables.get((dtype, device), (None, None))
        if cos is None or cos.shape[0] < end:
            n = max(end, 2 * (0 if cos is None else cos.shape[0]), 256)
            # Computed on the CPU for every device: a GPU layer rotates by the CPU engine's very values.
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq.float().cpu()[None]  # [n, d/2]
            emb = torch.cat((freqs, freqs), -1)  # [n, d]
            cos, sin = (emb.cos() * self.mscale).to(dtype), (emb.sin() * self.mscale).to(dtype)
            cos, sin = cos.to(device), sin.to(device)
            self._tables[(dtype, device)] = cos, sin
        return cos, sin

    def tables(self, pos: int | torch.Tensor, T: int, dtype: torch.dtype, device: torch.device | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions pos..pos+T (int) or for each of the positions in `pos` ([T] tensor),
        in `dtype` (one cached table per dtype and device: the compute dtype for torch, f32 for the native
        kernel)."""
        end = pos + T if isinstance(pos, int) else int(pos.max()) + 1
        cos, sin = self.all_rows(end, dtype, device)
        if isinstance(pos, int):
            return cos[pos:end], sin[pos:end]
        return cos[pos.to(cos.device)], sin[pos.to(cos.device)]  # gathered rows: the values a slice would give

    def forward(self, x: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] at positions pos..pos+T (int) or `pos` ([T]); rotates the first `dim` channels."""
        if x.dtype == torch.bfloat16 and not self.interleaved and x.device.type == "cpu" and native.available():
            return native.rope(x, *self.tables(pos, x.shape[0], torch.float32), self.dim)  # in f32, one rounding
        cos, sin = self.tables(pos, x.shape[0], x.dtype, x.device)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, d]
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if self.interleaved:  # pairs (0,1),(2,3)...: de-interleave, rotate, re-interleave
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), -1)
        half = self.dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), -1)
        out = rot * cos + rotated * sin
        if self.interleaved:
            out = torch.stack((out[..., :half], out[..., half:]), -1).flatten(-2)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), -1)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward (dense layers, shared experts)."""

    def __init__(self, hidden: int, intermediate: int, out_norm_eps: float | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        if out_norm_eps is not None:  # (a dense layer's output RMSNorm: AFMoE's)
            self.out_norm = RMSNorm(hidden, out_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_mlp.run(self, x)  # (bf16 decode rows of native weights: one call)
        if y is None:
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        norm = getattr(self, "out_norm", None)
        return y if norm is None else norm(y)

    def _apply(self, fn, recurse: bool = True):  # moved weights: rebuild the kernel's constants
        native_mlp.forget(self)
        return super()._apply(fn, recurse)


class DecoderBlock(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h)). `norm` given: a parallel block (Cohere),
    h + attn(norm(h)) + mlp(norm(h)), its one norm registered under both names (the attention's
    Output(parallel=True): the native block hands the MLP the input norm's output)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float, norm: nn.Module | None = None):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.parallel = norm is not None
        out = getattr(getattr(attn, "a", None), "output", None)  # (attention.py's Output piece)
        if self.parallel and not getattr(out, "parallel", False):
            raise ValueError("a parallel block's attention needs AttentionArgs(output=Output(parallel=True))")
        self.input_layernorm = norm if norm is not None else RMSNorm(hidden, eps)
        # (the same module twice: its weight is one parameter, and the look-ahead applies it to predict routes)
        self.post_attention_layernorm = norm if norm is not None else RMSNorm(hidden, eps)
        self.routed = isinstance(mlp, SparseMoE)

    def forward(self, h: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        # (the exact class's own `fused`: a subclass with its own forward must not be bypassed by it)
        fused = type(self.self_attn).__dict__.get("fused")
        out = None if fused is None else fused(self.self_attn, h, kv, self.input_layernorm,
                                               self.post_attention_layernorm)
        if out is not None:
            h, x = out
        elif self.parallel:
            x = self.input_layernorm(h)
            h = h + self.self_attn(x, kv)
        else:
            h = h + self.self_attn(self.input_layernorm(h), kv)
            x = self.post_attention_layernorm(h)
        fused = type(self.mlp).__dict__.get("fused")  # (SparseMoE's, or a subclass's own)
        out = None if fused is None else fused(self.mlp, x, h)
        if out is not None:
            return out
        # Routed experts also get the residual: their look-ahead predicts the next layer's routes from it.
        return h + (self.mlp(x, h) if self.routed else self.mlp(x))
