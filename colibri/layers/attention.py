"""Attention: the KV cache, `attend` (one sequence's rows over its keys), the named variants a family chooses (QKNorm,
OutGate), `AttentionArgs` and the shared `Attention` module with its fused native block (colibri/kernels/block.c).

q, k and v are split per head here; the rows of a step may belong to several sequences (layers/batch.py), and each
sequence's rows attend over its own cache.
"""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import arena
from ..kernels import native, native_attn, native_block
from .batch import LayerKV
from .kvquant import DEFAULT, KVType, KVTypes, check_dim, dequantize, quantize, row_bytes
from .layers import Linear, RoPE
from .norms import NoNorm, RMSNorm, block_norm_bias, is_rms, norm_weight_ptr, out_norm_ptr

# ----------------------------------------------------------------------------- KV cache


class KVCache:
    """Keys/values of one layer, preallocated for the whole context: `[Hkv, ctx, D]` each in the compute dtype, or
    quantized byte rows `[Hkv, ctx, row_bytes]` (layers/kvquant.py) where `types` asks for q8_0 / q4_0."""

    def __init__(self, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 v_head_dim: int | None = None, device: torch.device | str = "cpu", types: KVTypes = DEFAULT):
        self.dims = (head_dim, v_head_dim or head_dim)
        self.types, self.dtype, self.max_len = types, dtype, max_len
        for t, dim, what in ((types.k, head_dim, "key"), (types.v, self.dims[1], "value")):
            check_dim(t, dim, what)
        # (huge pages: colibri/arena.py)
        self.k, self.v = (arena.zeros((n_kv_heads, max_len, dim), dtype, device) if t == KVType.BF16
                          else arena.zeros((n_kv_heads, max_len, row_bytes(t, dim)), torch.uint8, device)
                          for t, dim in ((types.k, head_dim), (types.v, self.dims[1])))

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [Hkv, T, D] at positions start..start+T; returns everything up to there (for a one-row
        decode in a reduced precision, up to the next multiple of KV_BUCKET: see `kv_span`) in the compute
        dtype (a quantized cache's rows dequantized: the torch path's reading of it)."""
        end = self.write(k, v, start)
        span = kv_span(end, k.shape[1], self.max_len, k.dtype)
        return self.read(self.k, self.types.k, 0, span), self.read(self.v, self.types.v, 1, span)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> int:
        """k, v: [Hkv, T, D] into positions start..start+T (quantized where the cache is); returns the end."""
        end = start + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"context full: position {end} exceeds ctx-size {self.max_len}")
        for dst, t, x in ((self.k, self.types.k, k), (self.v, self.types.v, v)):
            dst[:, start:end] = x if t == KVType.BF16 else quantize(x, t)
        return end

    def read(self, cache: torch.Tensor, t: KVType, which: int, end: int, lo: int = 0) -> torch.Tensor:
        """Positions lo..end of the K (which 0) or V (1) tensor `cache` in the compute dtype [Hkv, S, D]."""
        rows = cache[:, lo:end]
        return rows if t == KVType.BF16 else dequantize(rows, t, self.dims[which], self.dtype)

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
        """The native blocks can write and read this cache next to `first` (the step's first): bf16 compute on
        the CPU, the same storage types, laid out alike (they take one pair of head strides for all rows)."""
        return isinstance(first, KVCache) and self.dtype == torch.bfloat16 and self.k.device.type == "cpu" \
            and self.types == first.types and self.k.stride() == first.k.stride() \
            and self.v.stride() == first.v.stride()


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
        return native_attn.attn_decode(q[:, 0], k[:, lo:valid], v[:, lo:valid], scale, sinks)
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


ROWS_SCORES = 1 << 23  # scores (f32) the native kernel holds at once for a prompt chunk's rows: 32 MiB


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, cache: KVCache, scale: float,
                window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's bf16 rows over a quantized cache: their k, v [Hkv, T, D] written, then the native kernel
    reading the quantized rows as they are -- no dequantized copy of the context, which for a prompt chunk deep in
    a long context cost more than the attention (and as much memory as a layer's bf16 cache). Row t (position
    start + t) sees the positions up to its own, within the window; rows go in groups whose scores fit
    ROWS_SCORES. q [H, T, D] -> [T, H * Dv]."""
    end = cache.write(k, v, start)
    H, T, _ = q.shape
    D, Dv = cache.dims
    qt = q.transpose(0, 1)  # [T, H, D]
    los = [p + 1 - window if window is not None and p + 1 > window else 0 for p in range(start, end)]
    group = max(1, ROWS_SCORES // (H * end))
    outs = []
    for g0 in range(0, T, group):
        rows = range(g0, min(T, g0 + group))
        outs.append(native_attn.attn_rows(qt[g0:rows.stop], [cache.k[:, los[t]:] for t in rows],
                                     [cache.v[:, los[t]:] for t in rows], [start + t + 1 - los[t] for t in rows],
                                     scale, sinks, kvt=cache.types.code, D=D, Dv=Dv))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class QKNorm(enum.IntEnum):
    """Where the queries and keys are RMS-normed; the values are coli_attn_layer's `qk_norm` codes (common.h)."""

    NONE = 0
    FULL = 1  # over the whole q / k projection, before the heads are split (OLMoE, MiniMax-M2)
    HEAD = 2  # each head alone, before the rotary (Qwen3)
    HEAD_POST_ROPE = 3  # each head alone, after the rotary (Hunyuan; Llama 4's L2 norm as weights of ones)


class OutGate(enum.IntEnum):
    """An output gate on the heads' outputs before o_proj, chosen by the family's attention subclass; the values
    are coli_attn_gate's `kind` codes (common.h)."""

    NONE = 0
    Q_SIGMOID = 1  # q_proj gives each head its query then its gate rows, times sigmoid(gate) (Qwen3-Next, AFMoE;
    # Beam adds a bias to the gate: coli_attn_gate's `bias`)
    CHANNEL_SOFTPLUS = 2  # g_proj gives a gate a channel, times softplus(gate) (Laguna)
    HEAD_SOFTPLUS = 3  # g_proj gives a gate a head, times softplus(gate) (Laguna's per-head gating)


@dataclass(frozen=True)
class Positions:
    """Where q and k get their positions: RoPE's base, scaling, table length and width."""

    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_pos: int = 4096
    rotary_dim: int | None = None  # partial rotary (GLM); None: head_dim
    use_rope: bool = True  # False: a NoPE layer (EXAONE's global layers), the rotary table kept for the others


@dataclass(frozen=True)
class Scores:
    """How q and k become the softmax's scores, and which keys a query sees."""

    scale: float | None = None  # None: 1 / sqrt(head_dim) (Granite: its attention_multiplier)
    sliding_window: int | None = None
    sinks: bool = False  # per-head attention sink logits in the softmax's denominator (gpt-oss)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] first (OLMoE, DBRX)


@dataclass(frozen=True)
class Values:
    """Values unlike the keys' heads (MiMo-V2-Flash)."""

    v_head_dim: int | None = None  # narrower or wider than q/k's heads; None: head_dim
    v_scale: float = 1.0  # values times this before they are cached


@dataclass(frozen=True)
class Output:
    """What follows the heads' outputs (a gate, if any, is the attention subclass's: OutGate)."""

    o_bias: bool = False  # o_proj's bias (gpt-oss)
    out_norm: bool = False  # an RMSNorm of o_proj's output before the residual add (AFMoE: `self_attn.out_norm`)
    parallel: bool = False  # the block's MLP reads this layer's input norm, not a post norm (Cohere: DecoderBlock's)


@dataclass
class AttentionArgs:
    """One attention layer: its shape and positions, then its variants as named pieces, each chosen in the family's
    file; the defaults are the plain Llama layer."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    positions: Positions
    _: KW_ONLY
    bias: bool = False  # q/k/v biases (Qwen2-MoE, GLM)
    qk_norm: QKNorm = QKNorm.NONE
    norm_eps: float = 1e-6  # the q/k norms' and the output norm's
    scores: Scores = Scores()
    values: Values = Values()
    output: Output = Output()

    def __post_init__(self):
        self.qk_norm = QKNorm(self.qk_norm)  # (a bare string or number is refused here, not deep in a kernel)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional q/k norm, bias and sliding window."""

    # the native block's constants for one (in_norm, post_norm) pair, built on first use; the sinks they point to
    _fused_layer: tuple[tuple[int, int], native_block.AttnLayer | None] | None = None
    _fused_sinks: torch.Tensor | None = None

    def __init__(self, a: AttentionArgs):
        super().__init__()
        self.a = a
        self.q_proj = Linear(a.hidden, a.heads * a.head_dim, a.bias)
        self.k_proj = Linear(a.hidden, a.kv_heads * a.head_dim, a.bias)
        self.v_dim = a.values.v_head_dim or a.head_dim
        self.v_proj = Linear(a.hidden, a.kv_heads * self.v_dim, a.bias)
        self.o_proj = Linear(a.heads * self.v_dim, a.hidden, a.output.o_bias)
        if a.output.out_norm:
            self.out_norm = RMSNorm(a.hidden, a.norm_eps)
        if a.qk_norm in (QKNorm.HEAD, QKNorm.HEAD_POST_ROPE):
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.norm_eps), RMSNorm(a.head_dim, a.norm_eps)
        elif a.qk_norm == QKNorm.FULL:
            self.q_norm = RMSNorm(a.heads * a.head_dim, a.norm_eps)
            self.k_norm = RMSNorm(a.kv_heads * a.head_dim, a.norm_eps)
        if a.scores.sinks:
            self.sinks = nn.Parameter(torch.zeros(a.heads), requires_grad=False)  # [H]
        p = a.positions
        self.rope = RoPE(p.rotary_dim or a.head_dim, p.rope_theta, p.rope_scaling, p.max_pos)
        self.scale = a.head_dim**-0.5 if a.scores.scale is None else a.scores.scale

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """x [T, hidden]: the step's rows; projections run on all rows, attention per sequence."""
        a, T = self.a, x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, H*D], [T, Hkv*D] x2
        if a.qk_norm == QKNorm.FULL:
            q, k = self.q_norm(q), self.k_norm(k)
        clip = a.scores.clip_qkv
        if clip is not None:
            q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
        q = q.view(T, a.heads, a.head_dim)
        k = k.view(T, a.kv_heads, a.head_dim)
        v = v.view(T, a.kv_heads, self.v_dim)
        if a.values.v_scale != 1.0:
            v = v * a.values.v_scale
        if a.qk_norm == QKNorm.HEAD:
            q, k = self.q_norm(q), self.k_norm(k)
        if a.positions.use_rope:
            q, k = self.rope(q, kv.pos), self.rope(k, kv.pos)
        if a.qk_norm == QKNorm.HEAD_POST_ROPE:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attend(q, k, v, kv, x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, x: torch.Tensor) -> torch.Tensor:
        """The step's q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] (normed and rotated): each sequence's keys and values
        cached, its rows attending over them, then `out` -> [T, hidden]."""
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D], [Hkv, T, D] x2
        sinks = self.sinks if self.a.scores.sinks else None
        outs = []
        window = self.a.scores.sliding_window
        for r0, r1, start, cache in kv.segs:
            if cache.types.quantized and q.dtype == torch.bfloat16 and q.device.type == "cpu" and native.available():
                outs.append(attend_rows(q[:, r0:r1], k[:, r0:r1], v[:, r0:r1], start, cache, self.scale, window,
                                        sinks))
                continue
            k_all, v_all = cache.update(k[:, r0:r1], v[:, r0:r1], start)
            outs.append(attend(q[:, r0:r1], k_all, v_all, start, self.scale, window, sinks))
        return self.out(outs[0] if len(outs) == 1 else torch.cat(outs), x)

    def out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs o [T, H*Dv] (a subclass may gate them by the input x), normed where the
        layer has an output norm (AFMoE)."""
        y = self.o_proj(o)
        return self.out_norm(y) if self.a.output.out_norm else y

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> KVCache:
        return KVCache(self.a.kv_heads, self.a.head_dim, max_len, dtype, self.v_dim, device, types)

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
        return native_attn.attn_block(layer, h.contiguous(), pos, kc, vc, c0.k.stride(0), c0.v.stride(0),
                                 cos.contiguous(), sin.contiguous(), kvt=c0.types.code)

    def _native_layer(self, in_norm: RMSNorm, post_norm: RMSNorm) -> native_block.AttnLayer | None:
        """The layer's constants for the native block, built once (None: the block does not apply)."""
        key = (id(in_norm), id(post_norm))
        cached = self._fused_layer
        if cached is not None and cached[0] == key:
            return cached[1]
        layer = self._build_native_layer(in_norm, post_norm) if native.available() else None
        self._fused_layer = (key, layer)
        return layer

    def _build_native_layer(self, in_norm: RMSNorm, post_norm: RMSNorm) -> native_block.AttnLayer | None:
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
        sinks = self.sinks.detach().float().contiguous() if a.scores.sinks else None  # (a tensor, not the Parameter)
        self._fused_sinks = sinks  # kept alive with the layer
        qn = (self.q_norm.weight.data_ptr(), self.k_norm.weight.data_ptr(), self.q_norm.eps) if a.qk_norm \
            else (0, 0, 0.0)
        vs = a.values.v_scale
        values = native_block.AttnValues(self.v_dim, vs) if (self.v_dim, vs) != (a.head_dim, 1.0) else None  # (MiMo's)
        parallel = a.output.parallel
        output = native_block.AttnOutput(*out, int(parallel)) if out[0] is not None or parallel else None
        return native_block.AttnLayer(
            a.hidden, a.heads, a.kv_heads, a.head_dim, 8 if first.scheme == "int8" else 4, first.group_size,
            *(native.QW() if p is None else native.QW(*native.qw(p)) for p in projs),
            norm_weight_ptr(in_norm), norm_weight_ptr(post_norm), in_norm.eps, post_norm.eps, *biases,
            a.qk_norm, *qn, a.scores.clip_qkv or 0.0, self.rope.dim if a.positions.use_rope else 0,
            a.scores.sliding_window or 0, self.scale, sinks.data_ptr() if sinks is not None else None,
            *(None if p is None or p.bias is None else p.bias.data_ptr() for p in projs),
            values=native_block.ref(values), output=native_block.ref(output))

    def _apply(self, fn, recurse: bool = True):  # .to(device) replaces the weights: rebuild the block's table
        self._fused_layer = None
        return super()._apply(fn, recurse)
