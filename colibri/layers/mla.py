"""Multi-head Latent Attention (DeepSeek-V2/V3) and its latent KV cache.

Keys and values are low-rank: every token writes one normalised latent `c` [R] (R =
kv_lora_rank) and one shared, rotated rope key `k_pe` [Dr]; `kv_b_proj` ([H*(Dn+Dv), R])
up-projects `c` into per-head k_nope [Dn] and v [Dv]. The cache keeps only `[c, k_pe]`:
R + Dr values per token and layer (576 for V3 shapes, against 128 x (192 + 128) = 40960
for expanded K and V).

Two equivalent ways to attend over it:
- "expanded": up-project the cached latents to full K/V every call, then plain attention.
  Costs S*R*H*(Dn+Dv) per call: cheap for a long prefill, ruinous for decode.
- "absorbed": fold kv_b_proj's K part into the query (q_nope @ W_uk -> a query in latent
  space) and its V part into the output (latent context @ W_uv^T), so attention runs as a
  single-head MQA directly over the cache. Costs ~H*T*S*(2R+Dr): the decode path.
"auto" (default) picks the one with fewer multiply-adds for the call at hand, which is
"absorbed" for decode (see benchmarks/bench_mla.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import arena
from ..kernels import native, native_mla
from .attention import attention_mask, kv_span
from .batch import LayerKV
from .kvquant import DEFAULT, KVTypes, refuse_quantized
from .layers import Linear, RMSNorm, RoPE, is_rms, yarn_get_mscale

MODES = ("auto", "absorbed", "expanded")
# The absorbed path scores at most this many (query row, key) pairs at once: 64 MiB of f32.
SCORE_ELEMS = 1 << 24
# DeepSeek builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclass
class MLAArgs:
    hidden: int
    heads: int
    q_lora_rank: int | None  # None: one q_proj (V2-Lite); else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: dict | None = None
    max_pos: int = 4096
    rope_interleave: bool = True  # rope pairs (0,1),(2,3)...; DeepSeek's native layout
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj


def softmax_scale(qk_head_dim: int, scaling: dict | None, max_pos: int) -> float:
    """1/sqrt(d), times mscale^2 under YaRN when `mscale_all_dim` is set (DeepSeek's long-context fix)."""
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        old = int(scaling.get("original_max_position_embeddings") or max_pos)
        factor = scaling.get("factor") or max_pos / old  # as rope_inv_freq
        m = yarn_get_mscale(float(factor), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


class LatentCache:
    """One layer's MLA cache: `[ctx, R + Dr]`, the normalised latent then the rotated rope key."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.kv = arena.zeros((max_len, kv_lora_rank + rope_dim), dtype, device)
        self.kv_lora_rank, self.max_len = kv_lora_rank, max_len

    def update(self, latent: torch.Tensor, start: int) -> torch.Tensor:
        """latent [T, R + Dr] at positions start..start+T; returns rows 0..start+T (a one-row decode in
        a reduced precision: up to the next multiple of KV_BUCKET, see layers.kv_span)."""
        end = start + latent.shape[0]
        if end > self.max_len:
            raise ValueError(f"context full: position {end} exceeds ctx-size {self.max_len}")
        self.kv[start:end] = latent
        return self.kv[: kv_span(end, latent.shape[0], self.max_len, latent.dtype)]

    def to(self, device: torch.device | str) -> LatentCache:
        self.kv = self.kv.to(device)
        return self

    def native_like(self, first: object) -> bool:
        """The native MLA block can write and read this cache next to `first` (the step's first): bf16 on
        the CPU, contiguous rows."""
        return isinstance(first, LatentCache) and self.kv.dtype == torch.bfloat16 \
            and self.kv.device.type == "cpu" and self.kv.is_contiguous()

    POS_DIM = 0  # the position axis of every tensor of `parts()`

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors that hold positions (copied between slots, saved to prompt cache files: engine/kv.py)."""
        return {"kv": self.kv}

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class MLAttention(nn.Module):
    """MLA over `LatentCache`s: `forward(x [T, hidden], kv: LayerKV) -> [T, hidden]`."""

    _fused_layer: tuple | None = None  # ((id(in_norm), id(post_norm)), the native block's constants), on first use

    def __init__(self, a: MLAArgs, mode: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"MLA mode must be one of {MODES}, got {mode!r}")
        self.a, self.mode = a, mode
        qk_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = Linear(a.hidden, a.heads * qk_dim)
        else:
            self.q_a_proj = Linear(a.hidden, a.q_lora_rank, a.bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(a.q_lora_rank, a.heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(a.hidden, a.kv_lora_rank + a.qk_rope_head_dim, a.bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(a.kv_lora_rank, a.heads * (a.qk_nope_head_dim + a.v_head_dim))
        self.o_proj = Linear(a.heads * a.v_head_dim, a.hidden, a.bias)
        self.rope = RoPE(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling, a.max_pos, a.rope_interleave)
        self.scale = softmax_scale(qk_dim, a.rope_scaling, a.max_pos)
        # (kv_b_proj it came from, W_uk [H, Dn, R], W_uv^T [H, R, Dv]): its two halves, dense and contiguous
        self._absorbed_w: tuple[nn.Module, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """x [T, hidden]: the step's rows; projections run on all rows, attention per sequence."""
        a, T = self.a, x.shape[0]
        Dn, R = a.qk_nope_head_dim, a.kv_lora_rank
        q = self.query(x).view(T, a.heads, Dn + a.qk_rope_head_dim)
        q_nope, q_pe = q[..., :Dn], self.rope(q[..., Dn:], kv.pos)  # [T, H, Dn], [T, H, Dr]
        if (s := self.q_scale(kv, T)) is not None:  # [T] (Mistral 4's long-context scaling)
            s = s.to(q.device, q.dtype)[:, None, None]
            q_nope, q_pe = q_nope * s, q_pe * s
        ckv = self.kv_a_proj_with_mqa(x)  # [T, R + Dr]
        c = self.kv_a_layernorm(ckv[:, :R])  # [T, R]
        k_pe = self.rope(ckv[:, None, R:], kv.pos)[:, 0]  # [T, Dr], shared by all heads
        new = torch.cat((c, k_pe), -1)  # [T, R + Dr]
        outs = []
        for r0, r1, start, cache in kv.segs:
            latent = cache.update(new[r0:r1], start)  # [S, R + Dr] (S may be bucketed: see kv_span)
            qn, qp = q_nope[r0:r1], q_pe[r0:r1]
            if self._use_absorbed(r1 - r0, start + r1 - r0):
                outs.append(self._absorbed(qn, qp, latent, start))
            else:
                outs.append(self._expanded(qn, qp, latent[: start + r1 - r0], start))
        return self.o_proj(self.out_gate(x, outs[0] if len(outs) == 1 else torch.cat(outs)))  # [T, hidden]

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The heads' queries [T, H (Dn + Dr)] before RoPE: q_proj, or the q LoRA."""
        return self.q_proj(x) if self.a.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def out_gate(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The heads' output o [T, H Dv] as o_proj takes it: o itself; a family's gate over it (Ling 3.0's)."""
        return o

    def q_scale(self, kv: LayerKV, T: int) -> torch.Tensor | None:
        """A factor [T] f32 for each row's query, or None (1): a family's position-dependent temperature."""
        return None

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm: RMSNorm,
              post_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + attn(in_norm(h)), post_norm of that) natively (kernels/mla.c: the absorbed form, scores and
        softmax in f32) for bf16 CPU rows of native projections, each sequence that takes it (`native_form`);
        in a step that mixes them, the others' rows as `forward` runs them, each sequence alone -- so a row's
        bits never depend on its neighbours'. None where no sequence takes it,
        or the weights or caches do not allow it (the caller then runs the layer as `forward`)."""
        if h.dtype != torch.bfloat16 or h.device.type != "cpu":
            return None
        absorbed = [self.native_form(r1 - r0, start + r1 - r0) for r0, r1, start, _ in kv.segs]
        if not any(absorbed):
            return None
        layer = self._native_layer(in_norm, post_norm)
        if layer is None:
            return None
        for (r0, r1, start, cache), a in zip(kv.segs, absorbed):
            if a and (not isinstance(cache, LatentCache) or not cache.native_like(cache)
                      or start + r1 - r0 > cache.max_len):
                return None  # (a full context: the unfused path raises the error)
        h = h.contiguous()
        if all(absorbed):
            return self._native_rows(layer, h, kv.segs, kv.pos)
        h_out, x_out = torch.empty_like(h), torch.empty_like(h)
        for (r0, r1, start, cache), a in zip(kv.segs, absorbed):
            one = LayerKV([(0, r1 - r0, start, cache)], start)
            if a:
                h_out[r0:r1], x_out[r0:r1] = self._native_rows(layer, h[r0:r1], one.segs, start)
            else:
                h_out[r0:r1] = ho = h[r0:r1] + self(in_norm(h[r0:r1]), one)
                x_out[r0:r1] = post_norm(ho)
        return h_out, x_out

    def _native_rows(self, layer: native_mla.MlaLayer, h: torch.Tensor, segs: list, pos: int | torch.Tensor,
                     sel: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """coli_mla_block over h [T, hidden] (contiguous) of `segs`, at most MOE_MAX_ROWS rows a call (a longer
        prompt chunk in pieces: each piece's rows see the latents the pieces before it wrote); `sel`: per row the
        positions it attends to (DSA's), or None for all."""
        rows, ptrs = [], []
        for r0, r1, start, cache in segs:
            rows.extend(range(start, start + r1 - r0))
            ptrs.extend([cache.kv.data_ptr()] * (r1 - r0))
        T, step = h.shape[0], native.MOE_MAX_ROWS
        cos, sin = self.rope.tables(pos, T, torch.float32)
        if T <= step:
            return native_mla.mla_block(layer, h, rows, ptrs, cos.contiguous(), sin.contiguous(), sel)
        outs = [native_mla.mla_block(layer, h[i : i + step].contiguous(), rows[i : i + step], ptrs[i : i + step],
                                     cos[i : i + step].contiguous(), sin[i : i + step].contiguous(),
                                     None if sel is None else sel[i : i + step])
                for i in range(0, T, step)]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def _native_layer(self, in_norm: RMSNorm, post_norm: RMSNorm) -> native_mla.MlaLayer | None:
        """The layer's constants for the native block, built once per norm pair (None: it does not apply)."""
        key = (id(in_norm), id(post_norm))
        kept = self._fused_layer
        if kept is None or kept[0] != key:
            kept = (key, self._build_native_layer(in_norm, post_norm) if native.available() else None)
            self._fused_layer = kept
        return kept[1]

    def _build_native_layer(self, in_norm: RMSNorm, post_norm: RMSNorm) -> native_mla.MlaLayer | None:
        a = self.a
        lora = a.q_lora_rank is not None
        projs = [self.q_a_proj, self.q_b_proj] if lora else [self.q_proj]
        projs += [self.kv_a_proj_with_mqa, self.o_proj]
        first = projs[0]
        if not all(getattr(p, "path", None) == "native" and p.scheme == first.scheme
                   and p.group_size == first.group_size and p.compute_dtype == torch.bfloat16 and native.bias_ok(p)
                   for p in projs) or (lora and self.q_b_proj.bias is not None) or self.kv_b_proj.bias is not None:
            return None
        if a.qk_rope_head_dim % 2 or a.qk_rope_head_dim > 512:  # (mla.c's rope: pairs, a 512-wide scratch)
            return None
        norms = [in_norm, post_norm, self.kv_a_layernorm] + ([self.q_a_layernorm] if lora else [])
        if any(not is_rms(n) or n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in norms):
            return None
        kvb = self.kv_b_proj  # (read as stored, int8 or int4: kernels/mla.c)
        if getattr(kvb, "path", None) != "native":
            return None
        qa = self.q_a_proj if lora else self.q_proj
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return native_mla.MlaLayer(
            a.hidden, a.heads, a.q_lora_rank or 0, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim, 8 if first.scheme == "int8" else 4, first.group_size,
            native.QW(*native.qw(qa)), native.QW(*native.qw(self.q_b_proj)) if lora else native.QW(),
            native.QW(*native.qw(self.kv_a_proj_with_mqa)), native.QW(*native.qw(self.o_proj)),
            in_norm.weight.data_ptr(), post_norm.weight.data_ptr(),
            self.q_a_layernorm.weight.data_ptr() if lora else None, self.kv_a_layernorm.weight.data_ptr(),
            in_norm.eps, post_norm.eps, LORA_NORM_EPS, int(self.rope.interleaved), self.scale,
            native.QW(*native.qw(kvb)), 8 if kvb.scheme == "int8" else 4, kvb.group_size, ptr(qa.bias),
            ptr(self.kv_a_proj_with_mqa.bias), ptr(self.o_proj.bias))

    def _apply(self, fn, recurse: bool = True):  # .to(device) replaces the weights: rebuild the block's table
        self._fused_layer = None
        return super()._apply(fn, recurse)

    def native_form(self, T: int, S: int) -> bool:
        """Whether a sequence's T rows (S positions with them) take the native block: in "auto", every call of
        up to MOE_MAX_ROWS rows -- a prompt's rows then get the bits they get one at a time, whether a cached
        prefix or a batch cut them into other pieces (on chunks of 8-64 rows torch's faster form takes 0.88-1.59x
        the block's time, benchmarks/bench_mla.py) -- and longer ones where the absorbed form has fewer
        multiply-adds; "absorbed" always, "expanded" never."""
        if self.mode == "auto" and T <= native.MOE_MAX_ROWS:
            return True
        return self._use_absorbed(T, S)

    def _use_absorbed(self, T: int, S: int) -> bool:
        if self.mode != "auto":
            return self.mode == "absorbed"
        a = self.a
        H, R, Dn, Dr, Dv = a.heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        expanded = S * R * H * (Dn + Dv) + H * T * S * (Dn + Dr + Dv)  # multiply-adds per call
        absorbed = H * T * R * (Dn + Dv) + H * T * S * (2 * R + Dr)
        return absorbed <= expanded

    def _expanded(self, q_nope, q_pe, latent, start, keep: torch.Tensor | None = None):
        """`keep`: bool [T, S], the positions each row may attend (causality included): a sparse selection."""
        a, T, S = self.a, q_nope.shape[0], latent.shape[0]
        R, Dn, Dv = a.kv_lora_rank, a.qk_nope_head_dim, a.v_head_dim
        kv = self.kv_b_proj(latent[:, :R]).view(S, a.heads, Dn + Dv)  # [S, H, Dn + Dv]
        k_pe = latent[:, None, R:].expand(S, a.heads, a.qk_rope_head_dim)  # [S, H, Dr]
        k = torch.cat((kv[..., :Dn], k_pe), -1).transpose(0, 1)  # [H, S, Dn + Dr]
        q = torch.cat((q_nope, q_pe), -1).transpose(0, 1)  # [H, T, Dn + Dr]
        # torch's CPU flash kernel (no [H, T, S] score matrix: long prefills stay small) wants 4-D inputs
        # and equal q/v widths, so the narrower side is zero-padded (zeros add nothing to q.k) and the padding
        # sliced off afterwards.
        W = max(k.shape[-1], Dv)
        if W > k.shape[-1]:  # (v wider than q/k: GLM's 256 vs 192 + 64 is equal, test models' wider)
            q, k = F.pad(q, (0, W - k.shape[-1])), F.pad(k, (0, W - k.shape[-1]))
        v = F.pad(kv[..., Dn:], (0, W - Dv)).transpose(0, 1)  # [H, S, W]
        mask = None if T == 1 or start == 0 else attention_mask(T, S, start, None, q.device)
        if keep is not None:
            mask = keep
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                             is_causal=keep is None and T > 1 and start == 0, scale=self.scale)[0]
        return out[..., :Dv].transpose(0, 1).reshape(T, a.heads * Dv)  # [T, H * Dv]

    def _absorbed(self, q_nope, q_pe, latent, start, keep: torch.Tensor | None = None):
        """`keep`: as `_expanded`'s, bool [T, <= S] (positions past it are not attended)."""
        a, T, S = self.a, q_nope.shape[0], latent.shape[0]
        if keep is not None and keep.shape[1] < S:  # (a bucketed tail of a bf16 decode: never attended)
            keep = F.pad(keep, (0, S - keep.shape[1]))
        H, R = a.heads, a.kv_lora_rank
        w_uk, w_uv_t = self.absorbed_weights(latent)  # [H, Dn, R], [H, R, Dv]
        # q_nope . (W_uk c) = (q_nope W_uk) . c: a query in latent space, per head
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, R]
        q = torch.cat((q_lat, q_pe.transpose(0, 1)), -1).reshape(H * T, -1)  # [H*T, R + Dr], rows (head, t)
        # Every head reads the same single latent "head", so all H*T query rows share one key matrix:
        # plain matmuls (SDPA would fall back to its slow path: the value width R differs from R + Dr).
        ctx = latent.new_empty(H * T, R)  # attention-weighted latents
        rows = max(1, SCORE_ELEMS // S)  # bound the [rows, S] f32 score block during long prefills
        for r in range(0, H * T, rows):
            scores = (q[r : r + rows] @ latent.T).float() * self.scale  # [rows, S]
            if T > 1 or S > start + 1:  # causal (query t sits at position start + t); masks a bucketed tail too
                t = torch.arange(r, min(r + rows, H * T), device=q.device) % T  # [rows]
                future = torch.arange(S, device=q.device)[None] > (start + t)[:, None]  # [rows, S]
                scores.masked_fill_(future, float("-inf"))
            if keep is not None:  # (a sparse selection: rows (head, t) take row t's)
                scores.masked_fill_(~keep[torch.arange(r, min(r + rows, H * T), device=q.device) % T], float("-inf"))
            ctx[r : r + rows] = torch.softmax(scores, -1).to(latent.dtype) @ latent[:, :R]
        out = torch.bmm(ctx.view(H, T, R), w_uv_t)  # [H, T, Dv]: then W_uv per head
        return out.transpose(0, 1).reshape(T, H * a.v_head_dim)

    def absorbed_weights(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's halves as dense W_uk [H, Dn, R] and W_uv^T [H, R, Dv] in `like`'s dtype/device, each
        contiguous (dequantized once, then kept: bmm copied a strided slice every call, ~1 MiB a layer and
        token on the benchmark shape); the same bytes as one dense kv_b_proj."""
        src, kept = self.kv_b_proj, self._absorbed_w
        if kept is None or kept[0] is not src or kept[1].device != like.device or kept[1].dtype != like.dtype:
            w = src.dequantized_weight() if hasattr(src, "dequantized_weight") else src.weight
            a = self.a
            w = w.to(device=like.device, dtype=like.dtype).view(a.heads, a.qk_nope_head_dim + a.v_head_dim,
                                                                 a.kv_lora_rank)
            Dn = a.qk_nope_head_dim
            self._absorbed_w = (src, w[:, :Dn].contiguous(), w[:, Dn:].transpose(1, 2).contiguous())
        return self._absorbed_w[1], self._absorbed_w[2]

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu",
                   types: KVTypes = DEFAULT) -> LatentCache:
        refuse_quantized(types, "the MLA latent cache")
        return LatentCache(self.a.kv_lora_rank, self.a.qk_rope_head_dim, max_len, dtype, device)
