"""Shared building blocks: weight placeholders, RoPE, KV cache, attention, dense MLP (the norms: norms.py).

Hidden states are 2-D `[T, H]` everywhere: the rows of one step, possibly of several sequences
(layers/batch.py); attention alone splits them per sequence. Placeholders (`Linear`,
`Embedding`) hold no weights: `models.base.bind()` swaps in what the store hands out,
so a model file never decides where or how a weight is stored.
"""

from __future__ import annotations

import enum
import math
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import arena
from ..kernels import native
from . import native_mlp
from .batch import LayerKV
from .moe import SparseMoE
from .norms import (  # noqa: F401 (LayerNorm, NoNorm, RMSNorm, is_rms, out_norm_ptr: re-exported)
    LayerNorm,
    NoNorm,
    RMSNorm,
    block_norm_bias,
    is_rms,
    norm_weight_ptr,
    out_norm_ptr,
    rms_norm,
)


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


# ----------------------------------------------------------------------------- KV cache


class KVCache:
    """Keys/values of one layer, preallocated for the whole context: `[Hkv, ctx, D]` each."""

    def __init__(self, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 v_head_dim: int | None = None, device: torch.device | str = "cpu"):
        self.k = arena.zeros((n_kv_heads, max_len, head_dim), dtype, device)  # (huge pages: colibri/arena.py)
        self.v = arena.zeros((n_kv_heads, max_len, v_head_dim or head_dim), dtype, device)
        self.max_len = max_len

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, T, D] at positions start..start+T; returns everything up to there (for a one-row
        decode in a reduced precision, up to the next multiple of KV_BUCKET: see `kv_span`)."""
        end = start + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"context full: position {end} exceeds ctx-size {self.max_len}")
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        span = kv_span(end, k.shape[1], self.max_len, k.dtype)
        return self.k[:, :span], self.v[:, :span]

    def to(self, device: torch.device | str) -> KVCache:
        self.k, self.v = self.k.to(device), self.v.to(device)
        return self

    POS_DIM = 1  # the position axis of every tensor of `parts()`

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors that hold positions (copied between slots, saved to prompt cache files: engine/kv.py)."""
        return {"k": self.k, "v": self.v}

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def native_like(self, first: object) -> bool:
        """The native blocks can write and read this cache next to `first` (the step's first): bf16 on
        the CPU, laid out alike (they take one pair of head strides for all rows)."""
        return isinstance(first, KVCache) and self.k.dtype == torch.bfloat16 and self.k.device.type == "cpu" \
            and self.k.stride() == first.k.stride() and self.v.stride() == first.v.stride()


KV_BUCKET = 128


def kv_span(end: int, T: int, max_len: int, dtype: torch.dtype) -> int:
    """Keys a one-row decode attends over: bf16/f16 matmuls run through oneDNN, which builds (and keeps)
    a kernel per shape, so a key length that grows every step grew RSS by ~1 GB over 4k tokens and
    paid a kernel build per token. Rounding up (the tail masked) to a multiple of KV_BUCKET, or of a
    quarter of the next power of two, keeps ~2 shapes per doubling of the context (each costs ~1 MiB of
    kernels) for at most a third more attention work. f32 (the oracle path) attends over exactly `end` keys."""
    if T != 1 or dtype == torch.float32:
        return end
    step = max(KV_BUCKET, 1 << max(0, end.bit_length() - 2))
    return min(max_len, -(-end // step) * step)


def attention_mask(T: int, S: int, start: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [T, S] mask (True = may attend) for queries at start..start+T over keys 0..S."""
    if T == 1 and (window is None or S <= window):
        return None
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


SINK_CHUNK_SCORES = 1 << 25  # scores held at once by the sink path (128 MiB of f32)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                       window: int | None, sinks: torch.Tensor, valid: int) -> torch.Tensor:
    """SDPA has no sink term: softmax over [scores | sink], then drop the sink column.

    q [H, T, D], k/v [Hkv, S, D] -> [H, T, Dv]. Query heads are grouped under their kv head, so the
    cache is never copied per query head; long prefills go in chunks of <= SINK_CHUNK_SCORES scores."""
    H, T, D = q.shape
    Hkv = k.shape[0]
    rep = H // Hkv
    if T == 1 and window is not None and valid > window:  # decode: the window is the newest keys
        k, v, window, valid = k[:, valid - window : valid], v[:, valid - window : valid], None, window
    S = k.shape[1]
    mask = attention_mask(T, S, start, window, q.device)  # [T, S] or None
    sink = sinks.float().view(Hkv, rep, 1, 1)
    qg = q.view(Hkv, rep, T, D)  # query head h = kv head h // rep
    step = max(1, SINK_CHUNK_SCORES // (H * S))
    outs = []
    for t0 in range(0, T, step):
        qc = qg[:, :, t0 : t0 + step]  # [Hkv, rep, t, D]
        t = qc.shape[2]
        scores = (qc.reshape(Hkv, rep * t, D) @ k.transpose(1, 2)).float().view(Hkv, rep, t, S) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask[t0 : t0 + step], float("-inf"))
        if valid < S:  # bucketed decode keys (kv_span): the tail is not this sequence's
            scores[..., valid:] = float("-inf")
        probs = torch.softmax(torch.cat((scores, sink.expand(Hkv, rep, t, 1)), -1), -1)[..., :S]
        outs.append((probs.to(v.dtype).reshape(Hkv, rep * t, S) @ v).view(H, t, -1))  # [H, t, Dv]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [H, T, D] at positions start.., k/v: [Hkv, S, D] (GQA by head groups) -> [T, H * Dv].

    The keys of this sequence are the first start + T; a decode row may get more (kv_span), masked.
    `sinks` [H]: a learned per-head logit that joins the softmax denominator only (gpt-oss)."""
    H, T, _ = q.shape
    valid = start + T
    if T == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu" and native.available():
        # One query in bf16: a native loop over exactly the valid keys, f32 scores (torch's bf16 bmm on
        # shapes this small costs ~150 us of setup per call). f32 stays on torch: the oracle path.
        lo = valid - window if window is not None and valid > window else 0
        return native.attn_decode(q[:, 0], k[:, lo:valid], v[:, lo:valid], scale, sinks)
    if sinks is not None:
        return _attend_with_sinks(q, k, v, start, scale, window, sinks, valid).transpose(0, 1).reshape(T, -1)
    if T == 1:  # decode: two small matmuls beat SDPA's kernel setup; heads grouped per kv head, no copies
        if window is not None and valid > window:
            k, v, valid = k[:, valid - window : valid], v[:, valid - window : valid], window
        Hkv = k.shape[0]
        qg = q.view(Hkv, H // Hkv, -1)  # [Hkv, rep, D]
        scores = (qg @ k.transpose(1, 2)).float() * scale  # [Hkv, rep, S]
        if valid < k.shape[1]:
            scores[..., valid:] = float("-inf")
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return (probs @ v).reshape(1, -1)  # [1, H * Dv]
    S = k.shape[1]
    # 4-D inputs with enable_gqa let torch pick its fused CPU kernel and skip copying K/V per head group.
    gqa = k.shape[0] != H
    if start == 0 and window is None:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = attention_mask(T, S, start, window, q.device)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa)
    out = out[0]
    return out.transpose(0, 1).reshape(T, -1)  # [T, H * Dv]


class QKNorm(enum.IntEnum):
    """Where the queries and keys are RMS-normed; the values are coli_attn_layer's `qk_norm` codes (common.h)."""

    NONE = 0
    FULL = 1  # over the whole q / k projection, before the heads are split (OLMoE, MiniMax-M2)
    HEAD = 2  # each head alone, before the rotary (Qwen3)
    HEAD_POST_ROPE = 3  # each head alone, after the rotary (Hunyuan; Llama 4's L2 norm as weights of ones)


class OutGate(enum.IntEnum):
    """An output gate on the heads' outputs before o_proj, chosen by the family's attention subclass; the values
    are coli_attn_layer's `gate` codes (common.h)."""

    NONE = 0
    Q_SIGMOID = 1  # q_proj gives each head its query then its gate rows, times sigmoid(gate) (Qwen3-Next, AFMoE;
    # Beam adds a bias to the gate: the layer's `bg`)
    CHANNEL_SOFTPLUS = 2  # g_proj gives a gate a channel, times softplus(gate) (Laguna)
    HEAD_SOFTPLUS = 3  # g_proj gives a gate a head, times softplus(gate) (Laguna's per-head gating)


@dataclass
class AttentionArgs:
    """One attention layer's shape and variants. Past the positional shape and rotary base, every field is a keyword,
    grouped by the stage of `Attention.forward` it changes; the default is the plain Llama layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None = None
    max_pos: int = 4096
    _: KW_ONLY
    # projections
    bias: bool = False  # q/k/v biases (Qwen2-MoE, GLM)
    o_bias: bool = False  # o_proj's bias (gpt-oss)
    # queries and keys
    qk_norm: QKNorm = QKNorm.NONE
    norm_eps: float = 1e-6  # the q/k norms' and the output norm's
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE, DBRX)
    # positions
    use_rope: bool = True  # False: a NoPE layer (EXAONE's global layers), the rotary table kept for the others
    rotary_dim: int | None = None  # partial rotary (GLM)
    sliding_window: int | None = None
    # scores
    scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim) (Granite: its attention_multiplier)
    sinks: bool = False  # per-head attention sink logits (gpt-oss)
    # values
    v_head_dim: int | None = None  # values narrower or wider than q/k's heads (MiMo-V2-Flash); None: head_dim
    v_scale: float = 1.0  # values times this before they are cached (MiMo-V2-Flash)
    # output and block
    out_norm: bool = False  # an RMSNorm of o_proj's output before the residual add (AFMoE: `self_attn.out_norm`)
    parallel: bool = False  # the block's MLP reads this layer's input norm, not a post norm (Cohere: DecoderBlock's)

    def __post_init__(self):
        self.qk_norm = QKNorm(self.qk_norm)  # (a bare string or number is refused here, not deep in a kernel)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional q/k norm, bias and sliding window."""

    def __init__(self, a: AttentionArgs):
        super().__init__()
        self.a = a
        self.q_proj = Linear(a.hidden, a.heads * a.head_dim, a.bias)
        self.k_proj = Linear(a.hidden, a.kv_heads * a.head_dim, a.bias)
        self.v_dim = a.v_head_dim or a.head_dim
        self.v_proj = Linear(a.hidden, a.kv_heads * self.v_dim, a.bias)
        self.o_proj = Linear(a.heads * self.v_dim, a.hidden, a.o_bias)
        if a.out_norm:
            self.out_norm = RMSNorm(a.hidden, a.norm_eps)
        if a.qk_norm in (QKNorm.HEAD, QKNorm.HEAD_POST_ROPE):
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.norm_eps), RMSNorm(a.head_dim, a.norm_eps)
        elif a.qk_norm == QKNorm.FULL:
            self.q_norm = RMSNorm(a.heads * a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.kv_heads * a.head_dim, a.norm_eps)
        if a.sinks:
            self.sinks = nn.Parameter(torch.zeros(a.heads), requires_grad=False)  # [H]
        self.rope = RoPE(a.rotary_dim or a.head_dim, a.rope_theta, a.rope_scaling, a.max_pos)
        self.scale = a.head_dim**-0.5 if a.scale is None else a.scale

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """x [T, hidden]: the step's rows; projections run on all rows, attention per sequence."""
        a, T = self.a, x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, H*D], [T, Hkv*D] x2
        if a.qk_norm == QKNorm.FULL:
            q, k = self.q_norm(q), self.k_norm(k)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(T, a.heads, a.head_dim)
        k = k.view(T, a.kv_heads, a.head_dim)
        v = v.view(T, a.kv_heads, self.v_dim)
        if a.v_scale != 1.0:
            v = v * a.v_scale
        if a.qk_norm == QKNorm.HEAD:
            q, k = self.q_norm(q), self.k_norm(k)
        if a.use_rope:
            q, k = self.rope(q, kv.pos), self.rope(k, kv.pos)
        if a.qk_norm == QKNorm.HEAD_POST_ROPE:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attend(q, k, v, kv, x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, x: torch.Tensor) -> torch.Tensor:
        """The step's q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] (normed and rotated): each sequence's keys and values
        cached, its rows attending over them, then `out` -> [T, hidden]."""
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D], [Hkv, T, D] x2
        sinks = self.sinks if self.a.sinks else None
        outs = []
        for r0, r1, start, cache in kv.segs:
            k_all, v_all = cache.update(k[:, r0:r1], v[:, r0:r1], start)
            outs.append(attend(q[:, r0:r1], k_all, v_all, start, self.scale, self.a.sliding_window, sinks))
        return self.out(outs[0] if len(outs) == 1 else torch.cat(outs), x)

    def out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs o [T, H*Dv] (a subclass may gate them by the input x), normed where the
        layer has an output norm (AFMoE)."""
        y = self.o_proj(o)
        return self.out_norm(y) if self.a.out_norm else y

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu") -> KVCache:
        return KVCache(self.a.kv_heads, self.a.head_dim, max_len, dtype, self.v_dim, device)

    # ------------------------------------------------------------------ the fused native block

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm: RMSNorm, post_norm: RMSNorm
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + self(in_norm(h)), post_norm(that)) in one native call (colibri/kernels/block.c) for a
        few bf16 rows, with the bits of the unfused native path; None where it does not apply."""
        T = h.shape[0]
        if h.dtype != torch.bfloat16 or h.device.type != "cpu" or T > native.MOE_MAX_ROWS:
            return None
        layer = self._native_layer(in_norm, post_norm)
        if layer is None:
            return None
        pos, kc, vc = [], [], []
        c0 = kv.segs[0][3]
        for r0, r1, start, cache in kv.segs:
            if not isinstance(cache, KVCache) or not cache.native_like(c0) or start + r1 - r0 > cache.max_len:
                return None  # (a full context: the unfused path raises the error)
            pos.extend(range(start, start + r1 - r0))
            kc.extend([cache.k.data_ptr()] * (r1 - r0))
            vc.extend([cache.v.data_ptr()] * (r1 - r0))
        cos, sin = self.rope.tables(kv.pos, T, torch.float32)
        return native.attn_block(layer, h.contiguous(), pos, kc, vc, c0.k.stride(0), c0.v.stride(0),
                                 cos.contiguous(), sin.contiguous())

    def _native_layer(self, in_norm: RMSNorm, post_norm: RMSNorm) -> native.AttnLayer | None:
        """The layer's constants for the native block, built once (None: the block does not apply)."""
        key = (id(in_norm), id(post_norm))
        cached = self.__dict__.get("_fused_layer")
        if cached is not None and cached[0] == key:
            return cached[1]
        layer = self._build_native_layer(in_norm, post_norm) if native.available() else None
        self.__dict__["_fused_layer"] = (key, layer)
        return layer

    def _build_native_layer(self, in_norm: RMSNorm, post_norm: RMSNorm) -> native.AttnLayer | None:
        a = self.a
        projs = (self.q_proj, self.k_proj, getattr(self, "v_proj", None), self.o_proj)  # (None: keys as values)
        first = projs[0]
        if not all(getattr(p, "path", None) == "native" and p.scheme == first.scheme
                   and p.group_size == first.group_size and p.compute_dtype == torch.bfloat16 and native.bias_ok(p)
                   for p in projs if p is not None):
            return None
        norms = [in_norm, post_norm] + ([self.q_norm, self.k_norm] if a.qk_norm else [])
        biases = [block_norm_bias(in_norm), block_norm_bias(post_norm)]  # (LayerNorms: Phi-3.5-MoE)
        if self.rope.interleaved or False in biases \
                or not all(is_rms(n) for n in norms[2:]) \
                or any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms
                       if type(n) is not NoNorm):
            return None
        out = out_norm_ptr(self)
        if out is None:
            return None
        sinks = self.sinks.float().contiguous() if a.sinks else None
        self.__dict__["_fused_sinks"] = sinks  # kept alive with the layer
        qn = (self.q_norm.weight.data_ptr(), self.k_norm.weight.data_ptr(), self.q_norm.eps) if a.qk_norm \
            else (0, 0, 0.0)
        return native.AttnLayer(
            a.hidden, a.heads, a.kv_heads, a.head_dim, 8 if first.scheme == "int8" else 4, first.group_size,
            *(native.QW() if p is None else native.QW(*native.qw(p)) for p in projs),
            norm_weight_ptr(in_norm), norm_weight_ptr(post_norm), in_norm.eps, post_norm.eps,
            a.qk_norm, *qn, a.clip_qkv or 0.0,
            self.rope.dim if a.use_rope else 0,
            a.sliding_window or 0, self.scale, sinks.data_ptr() if sinks is not None else None,
            *(None if p is None or p.bias is None else p.bias.data_ptr() for p in projs), v_dim=self.v_dim,
            v_scale=a.v_scale,
            in_b=biases[0], post_b=biases[1], out_w=out[0], out_eps=out[1], parallel=int(a.parallel))

    def _apply(self, fn, recurse: bool = True):  # .to(device) replaces the weights: rebuild the block's table
        self.__dict__.pop("_fused_layer", None)
        return super()._apply(fn, recurse)


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
    AttentionArgs.parallel set: the native block hands the MLP the input norm's output)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float, norm: nn.Module | None = None):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.parallel = norm is not None
        if self.parallel and not getattr(getattr(attn, "a", None), "parallel", False):
            raise ValueError("a parallel block's attention needs AttentionArgs(parallel=True)")
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
