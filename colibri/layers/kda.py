"""Kimi Delta Attention (Kimi-Linear's linear-attention layers): Gated DeltaNet (linear_attn.py) with a decay per
key channel instead of per head. Per row: q, k, v = silu(causal depthwise conv of q_proj x, k_proj x, v_proj x) (one
conv over the three, no bias, its last K-1 inputs kept), q and k L2-normalised (q also times D^-1/2), and per head

    S <- diag(exp(g)) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

with g = -exp(A_log[h]) softplus(f_b_proj(f_a_proj x) + dt_bias) [H, D] and beta = sigmoid(b_proj x) [H]. The
heads' outputs are RMS-normed per head, times their weight, times sigmoid(g_b_proj(g_a_proj x)), then o_proj.
Ling 3.0's variant (`bailing_hybrid`) takes f and the gate from one full projection each (f_proj, g_proj) and may
bound the decay: g = lower_bound sigmoid(exp(A_log[h]) (f + dt_bias)) (`KDAArgs.lower_bound` < 0).

The state (conv inputs and S [H, D, D] in f32) stands in for a KV cache, so prompt caching stays off. Every
position takes the recurrence in f32 (prompts too: transformers' chunked form is the same sums in another order); a
decay per channel has no cheap chunked form that stays stable without FLA's sub-chunks. bf16 rows of native weights
take everything between the projections and o_proj in kernels/kda.c (decode rows in one call, a prompt's rows in
order inside the call), and decode rows the whole block from the input norm to the post norm (`fused`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, native_kda
from .batch import LayerKV
from .kvquant import DEFAULT, KVTypes
from .layers import Linear
from .linear_attn import Conv1d, StateCache, block_weights, forget_block_weights, step_states, verify_rows


@dataclass
class KDAArgs:
    hidden: int
    heads: int
    head_dim: int
    conv_kernel: int
    eps: float  # the output norm's (rms_norm_eps)
    low_rank: bool = True  # f and the output gate through [D]-wide pairs (Kimi), else one projection each (Ling)
    lower_bound: float = 0.0  # < 0: Ling's bounded decay lower_bound sigmoid(exp(A_log) (f + dt)); 0: Kimi's softplus
    a_log_shape: tuple[int, ...] | None = None  # A_log as the checkpoint stores it: Kimi's [1, 1, H, 1] by default


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps): FLA's form, as transformers' KDA (Qwen3-Next's multiplies by rsqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_step(q, k, v, g, beta, S: torch.Tensor) -> torch.Tensor:
    """One position: q, k, v [H, D], g [H, D], beta [H] (f32; q, k normalised, q scaled); S [H, D, D] updated in
    place. Returns o [H, D]."""
    S.mul_(g.exp()[:, :, None])
    mem = (S * k[:, :, None]).sum(-2)  # [H, D]: what the state recalls for k
    S.add_(k[:, :, None] * ((v - mem) * beta[:, None])[:, None, :])
    return (S * q[:, :, None]).sum(-2)


class GatedHeadNorm(nn.Module):
    """Each head's RMSNorm in f32, times its weight, times sigmoid(gate) (transformers' KimiLinearRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return (xf * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """x [T, hidden] -> [T, hidden] over the step's sequences, each continuing its own `StateCache`."""

    _conv_w: torch.Tensor | None = None  # the three short convolutions' weights as one, built on first use

    def __init__(self, a: KDAArgs):
        super().__init__()
        self.a = a
        HD = a.heads * a.head_dim
        self.q_proj, self.k_proj, self.v_proj = Linear(a.hidden, HD), Linear(a.hidden, HD), Linear(a.hidden, HD)
        # (the checkpoint's three convolutions; one conv over their concatenation, as transformers runs them)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (Conv1d(HD, a.conv_kernel) for _ in range(3))
        if a.low_rank:
            self.f_a_proj, self.f_b_proj = Linear(a.hidden, a.head_dim), Linear(a.head_dim, HD)
            self.g_a_proj, self.g_b_proj = Linear(a.hidden, a.head_dim), Linear(a.head_dim, HD)
        else:
            self.f_proj, self.g_proj = Linear(a.hidden, HD), Linear(a.hidden, HD)
        self.dt_bias = nn.Parameter(torch.zeros(HD), requires_grad=False)  # [H*D]
        self.A_log = nn.Parameter(torch.zeros(a.a_log_shape or (1, 1, a.heads, 1)), requires_grad=False)  # H values
        self.b_proj = Linear(a.hidden, a.heads)
        self.o_norm = GatedHeadNorm(a.head_dim, a.eps)
        self.o_proj = Linear(HD, a.hidden)

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        # (a recurrent state stays in the compute dtype whatever the K/V cache types)
        a = self.a
        return StateCache(3 * a.heads * a.head_dim, a.conv_kernel, a.heads, a.head_dim, a.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if (y := verify_rows(self.forward, x, kv)) is not None:  # (a speculative verify: linear_attn.py)
            return y
        a, T = self.a, x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, H D] each
        if self._native_rows(x, kv):  # bf16 rows: conv, gates, delta rule and gated norm in kernels/kda.c
            parts = tuple(t.contiguous() for t in (q, k, v, self._f(x), self.b_proj(x), self._gate(x)))
            w = self._conv_weight().view(3 * a.heads * a.head_dim, -1)
            if T <= native.MOE_MAX_ROWS and all(r1 - r0 == 1 for r0, r1, _, _ in kv.segs):  # decode rows: one call
                conv, ssm = step_states(kv)
                return self.o_proj(native_kda.kda_rows(self, *parts, conv, ssm, w))
            o = torch.empty(T, a.heads * a.head_dim, dtype=x.dtype)
            step = native.MOE_MAX_ROWS
            for r0, r1, start, cache in kv.segs:  # a prompt's rows: in order, up to MOE_MAX_ROWS a call
                cache.resume(start)
                for t in range(r0, r1, step):
                    e = min(t + step, r1)
                    o[t:e] = native_kda.kda_rows(self, *(p[t:e] for p in parts), [cache.conv.data_ptr()],
                                                 [cache.ssm.data_ptr()], w, seq=True)
                cache.pos = start + r1 - r0
            return self.o_proj(o)
        qkv = torch.cat((q, k, v), -1)  # [T, 3 H D]
        f = (self._f(x).float() + self.dt_bias.float()).view(T, a.heads, a.head_dim)
        rate = self.A_log.float().view(a.heads, 1).exp()  # [H, 1]
        if a.lower_bound:  # (Ling's bounded decay)
            g = a.lower_bound * torch.sigmoid(rate * f)
        else:
            g = -rate * torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
        beta = torch.sigmoid(self.b_proj(x)).float()  # [T, H] (in x's dtype first, as transformers)
        outs = []
        for r0, r1, start, cache in kv.segs:
            cache.resume(start)
            outs.append(self._sequence(qkv[r0:r1], g[r0:r1], beta[r0:r1], cache))
            cache.pos = start + r1 - r0
        o = (outs[0] if len(outs) == 1 else torch.cat(outs)).to(x.dtype)  # [T, H, D]
        gate = self._gate(x).view(T, a.heads, a.head_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(T, -1))

    def _f(self, x: torch.Tensor) -> torch.Tensor:  # [T, H D]: the decay's input before dt_bias
        return self.f_b_proj(self.f_a_proj(x)) if self.a.low_rank else self.f_proj(x)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:  # [T, H D]: the output gate before its sigmoid
        return self.g_b_proj(self.g_a_proj(x)) if self.a.low_rank else self.g_proj(x)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + self(in_norm(h)), post_norm(that)) in one native call (kernels/kda.c coli_kda_block) for bf16 decode
        rows of native weights, with the bits of the layer-by-layer native path; else None."""
        a, T = self.a, h.shape[0]
        low = (self.f_a_proj, self.g_a_proj, self.f_b_proj, self.g_b_proj) if a.low_rank else (self.f_proj,
                                                                                               self.g_proj)
        projs = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *low, self.o_proj)
        if T > native.MOE_MAX_ROWS or not self._native_rows(h, kv) \
                or any(r1 - r0 != 1 for r0, r1, _, _ in kv.segs) \
                or (w := block_weights(self, projs, in_norm, post_norm)) is None:
            return None
        conv, ssm = step_states(kv)
        first = projs[0]
        return native_kda.kda_block(self, 8 if first.scheme == "int8" else 4, first.group_size, w, h.contiguous(),
                                    in_norm, post_norm, conv, ssm,
                                    self._conv_weight().view(3 * a.heads * a.head_dim, -1))

    def _native_rows(self, x: torch.Tensor, kv: LayerKV) -> bool:
        """Whether kernels/kda.c takes this step: bf16 CPU rows, bf16 conv states, f32 parameters (the f32 oracle path
        stays in torch)."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or self.a.head_dim > native_kda.MAX_D \
                or not native.available():
            return False
        params = (self.q_conv1d.weight, self.dt_bias, self.A_log, self.o_norm.weight)
        return all(p.dtype == torch.float32 and p.is_contiguous() for p in params) \
            and all(c.conv.dtype == torch.bfloat16 and c.conv.is_contiguous() for *_, c in kv.segs)

    def _conv_weight(self) -> torch.Tensor:
        w = self._conv_w
        if w is None:
            w = self._conv_w = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight,
                                                      self.v_conv1d.weight))  # [3 H D, 1, K]
        return w

    def _apply(self, fn, recurse: bool = True):  # moved weights: the concatenated conv and the block's pointers go
        self._conv_w = None
        forget_block_weights(self)
        return super()._apply(fn, recurse)

    def _sequence(self, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cache: StateCache) -> torch.Tensor:
        """One sequence's n rows x [n, 3 H D] -> o [n, H, D] (f32), its state moved on by n positions."""
        a, n = self.a, x.shape[0]
        K = a.conv_kernel
        seq = torch.cat([cache.conv, x.T.to(cache.conv.dtype)], -1)  # [C, K-1+n]: the kept inputs first
        cache.conv.copy_(seq[:, -(K - 1):])
        w = self._conv_weight()
        y = F.silu(F.conv1d(seq[None].to(w.dtype), w, groups=w.shape[0])[0]).T  # [n, C]
        q, k, v = y.float().view(n, 3, a.heads, a.head_dim).unbind(1)  # [n, H, D] each
        q, k = l2norm(q) * a.head_dim**-0.5, l2norm(k)
        return torch.stack([kda_step(q[t], k[t], v[t], g[t], beta[t], cache.ssm) for t in range(n)])
