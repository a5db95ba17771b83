"""Mamba-2 mixer layers (Granite 4.0-H's `linear_attention` layers): a selective state space in place of attention.

    in_proj(x) -> z [I], xBC [I + 2 G N], dt [H]           (I = H * P: H heads of P channels; G groups of N states)
    xBC <- silu(causal depthwise conv of xBC over the last K inputs);  x [H, P], B, C [G, N] each
    dt  <- softplus(dt + dt_bias);  A = -exp(A_log)                 (per head)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T      y_t = S_t C_t + D x_t    (S [H, P, N]; head h reads group h/(H/G))
    out_proj(RMSNorm_per_group(y * silu(z)))

A sequence's state is the convolution's last K-1 inputs and S (linear attention's `StateCache`): a slot holds it
instead of K/V positions, it cannot be rewound (no prompt caching: linear_attn.py), and a step continues each
sequence where its state stands. Prompts take the chunked (SSD) form in f32, as transformers' torch implementation
does, clamping dt to `time_step_limit`; a decode row takes the recurrence, which (as transformers' and the
reference kernels' step) does not clamp. bf16 decode rows take kernels/mamba.c (the rows' convolution, state update
and gated norm in one call, or the whole block with its norms, projections and residual); the f32 oracle path and
prompts stay in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, native_mamba
from .batch import LayerKV
from .kvquant import DEFAULT, KVTypes
from .layers import Linear
from .linear_attn import Conv1d, StateCache, block_weights, forget_block_weights, step_states, verify_rows


@dataclass
class Mamba2Args:
    hidden: int
    heads: int  # H
    head_dim: int  # P
    state: int  # N
    groups: int  # G
    conv_kernel: int  # K
    chunk: int  # a prompt's positions per SSD chunk
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


class GroupGatedRMSNorm(nn.Module):
    """y * silu(z), RMS-normed over each of `groups` equal slices of the channels, times the weight."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = (y.float() * F.silu(z.float())).unflatten(-1, (self.groups, -1))  # [T, G, I/G]
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * g.flatten(-2).to(y.dtype)).to(y.dtype)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., l, s] = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal (exp of it
    is the decay from position s to l). Summed from masked copies rather than as a difference of cumulative sums,
    which loses the small terms."""
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)  # [..., l, s] = a[l]
    x = x.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1), 0).cumsum(-2)
    return x.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(), -torch.inf)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                S: torch.Tensor, chunk: int) -> torch.Tensor:
    """n positions at once (f32): x [n, H, P], dt [n, H] (final), A [H], B, C [n, H, N] (per head); S [H, P, N]
    updated in place. Returns y [n, H, P] without the D term.

    Inside a chunk the outputs are a masked product, y = ((C B^T) * exp(segsum(dt A))) (dt x); each chunk's
    contribution to the state at its end is (B exp(decay to the end))^T (dt x); chunk by chunk, the state entering a
    chunk adds (C S) exp(cumsum(dt A)) to its outputs and decays by the chunk's whole product."""
    n, H, P = x.shape
    chunk = min(chunk, n)  # (a shorter prompt is one chunk of its own length: no padding to compute through)
    pad = -n % chunk
    c = (n + pad) // chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [c, chunk, ...]
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(c, chunk, *t.shape[1:])

    xs, Bc, Cc = chunks(x * dt[..., None]), chunks(B), chunks(C)  # [c, l, H, P], [c, l, H, N] x2
    a = chunks(dt * A).permute(2, 0, 1)  # [H, c, l]
    acum = a.cumsum(-1)
    scores = torch.einsum("clhn,cshn->hcls", Cc, Bc) * segsum(a).exp()  # [H, c, l, s]
    y = torch.einsum("hcls,cshp->clhp", scores, xs)
    to_end = (acum[..., -1:] - acum).exp()  # [H, c, l]
    own = torch.einsum("clhn,hcl,clhp->chpn", Bc, to_end, xs)  # [c, H, P, N]
    state = S.clone()
    for i in range(c):
        y[i] += torch.einsum("lhn,hpn->lhp", Cc[i], state) * acum[:, i].T.exp()[..., None]
        state = state * acum[:, i, -1].exp()[:, None, None] + own[i]
    S.copy_(state)
    return y.reshape(c * chunk, H, P)[:n]


class Mamba2Mixer(nn.Module):
    """x [T, hidden] -> [T, hidden] over the step's sequences, each continuing its own `StateCache`."""

    def __init__(self, a: Mamba2Args):
        super().__init__()
        self.a = a
        self.in_proj = Linear(a.hidden, a.inner + a.conv_dim + a.heads, a.proj_bias)
        self.conv1d = Conv1d(a.conv_dim, a.conv_kernel)  # weight [C, 1, K]
        if a.conv_bias:
            self.conv1d.bias = nn.Parameter(torch.zeros(a.conv_dim), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(a.heads), requires_grad=False)  # [H]
        self.A_log = nn.Parameter(torch.zeros(a.heads), requires_grad=False)  # [H]
        self.D = nn.Parameter(torch.ones(a.heads), requires_grad=False)  # [H]
        self.norm = GroupGatedRMSNorm(a.inner, a.groups, a.eps)
        self.out_proj = Linear(a.inner, a.hidden, a.proj_bias)

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        # (a recurrent state stays in the compute dtype whatever the K/V cache types)
        a = self.a
        return StateCache(a.conv_dim, a.conv_kernel, a.heads, a.head_dim, a.state, dtype, device)

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if (y := verify_rows(self.forward, x, kv)) is not None:  # (a speculative verify: linear_attn.py)
            return y
        a = self.a
        if self._native_rows(x, kv):  # bf16 decode rows: convolution, state and gated norm in one call
            return self.out_proj(native_mamba.mamba_rows(self, self.in_proj(x).contiguous(), *step_states(kv)))
        z, xbc, dt = self.in_proj(x).split([a.inner, a.conv_dim, a.heads], -1)  # [T, I], [T, C], [T, H]
        outs = []
        for r0, r1, start, cache in kv.segs:
            cache.resume(start)
            outs.append(self._sequence(xbc[r0:r1], dt[r0:r1], cache, start > 0))
            cache.pos = start + r1 - r0
        y = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, P] f32
        return self.out_proj(self.norm(y.flatten(1).to(x.dtype), z))

    def _conv(self, xbc: torch.Tensor, cache: StateCache, continuing: bool) -> torch.Tensor:
        """silu of the causal convolution of one sequence's rows xbc [n, C] after its kept inputs -> [n, C] f32;
        the last K-1 inputs kept."""
        K, n = self.a.conv_kernel, xbc.shape[0]
        w, bias = self.conv1d.weight, getattr(self.conv1d, "bias", None)
        seq = torch.cat([cache.conv, xbc.T.to(cache.conv.dtype)], -1)  # [C, K-1+n]
        if continuing:
            y = F.conv1d(seq[None].to(w.dtype), w, bias, groups=self.a.conv_dim)[0]  # [C, n]
        else:  # (from zeros: the padded form transformers computes)
            y = F.conv1d(xbc.T[None].to(w.dtype), w, bias, padding=K - 1, groups=self.a.conv_dim)[0, :, :n]
        cache.conv.copy_(seq[:, -(K - 1):])
        return F.silu(y.float()).T

    def _sequence(self, xbc: torch.Tensor, dt: torch.Tensor, cache: StateCache, continuing: bool) -> torch.Tensor:
        """One sequence's n rows -> y [n, H, P] (f32), its state moved on by n positions: a decode row takes the
        recurrence, a prompt (or a chunk of one) the chunked form from the state."""
        a, n = self.a, xbc.shape[0]
        u = self._conv(xbc, cache, continuing)
        x, B, C = u.split([a.inner, a.groups * a.state, a.groups * a.state], -1)
        x = x.view(n, a.heads, a.head_dim)  # [n, H, P]
        r = a.heads // a.groups
        B, C = (t.view(n, a.groups, a.state).repeat_interleave(r, 1) for t in (B, C))  # [n, H, N]
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [n, H]
        A = -self.A_log.float().exp()
        D = self.D.float()[:, None]
        S = cache.ssm  # [H, P, N] f32
        if n == 1 and continuing:
            dB = dt[0, :, None] * B[0]  # [H, N]
            S.mul_((dt[0] * A).exp()[:, None, None]).add_(dB[:, None, :] * x[0, :, :, None])
            return (torch.bmm(S, C[0, :, :, None])[..., 0] + x[0] * D)[None]
        dt = dt.clamp(*a.dt_limit)
        return ssd_chunked(x, dt, A, B, C, S, a.chunk) + x * D

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + self(in_norm(h)), post_norm(that)) in one native call (kernels/mamba.c coli_mamba_block) for bf16
        decode rows of native weights, with the bits of the layer-by-layer native path; else None."""
        first = self.in_proj
        if not self._native_rows(h, kv) \
                or (w := block_weights(self, (first, self.out_proj), in_norm, post_norm)) is None:
            return None
        return native_mamba.mamba_block(self, 8 if first.scheme == "int8" else 4, first.group_size, w,
                                        h.contiguous(), in_norm, post_norm, *step_states(kv))

    def _native_rows(self, x: torch.Tensor, kv: LayerKV) -> bool:
        """Whether kernels/mamba.c takes this step: bf16 rows on the CPU, one per sequence, each continuing its
        state, f32 parameters; the f32 oracle path and prompts stay in torch."""
        params = (self.conv1d.weight, getattr(self.conv1d, "bias", None), self.dt_bias, self.A_log, self.D,
                  self.norm.weight)
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] <= native.MOE_MAX_ROWS \
            and self.a.state <= native_mamba.MAX_STATE and native.available() \
            and all(p is None or (p.dtype == torch.float32 and p.is_contiguous()) for p in params) \
            and all(r1 - r0 == 1 and start > 0 and c.conv.dtype == torch.bfloat16 and c.conv.is_contiguous()
                    and c.conv.device.type == "cpu" for r0, r1, start, c in kv.segs)

    def _apply(self, fn, recurse: bool = True):  # moved weights: the fused call's pointers are stale
        forget_block_weights(self)
        return super()._apply(fn, recurse)
