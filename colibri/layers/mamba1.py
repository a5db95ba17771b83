"""Mamba (the first, selective-scan form: Jamba's `mamba` layers), a state space in place of attention.

    in_proj(x) -> x [I], z [I];  u = silu(causal depthwise conv of x over the last K inputs)
    x_proj(u) -> dt [R], B [N], C [N]   (Jamba RMS-norms each: `inner_norms`)
    dt <- softplus(dt_proj(dt))   [I];  A = -exp(A_log)   [I, N]
    S_t = exp(dt_t A) * S_{t-1} + (dt_t B_t^T) * u_t      y_t = S_t C_t + D u_t         (S [I, N], per channel)
    out_proj(y * silu(z))

A sequence's state is the convolution's last K-1 inputs and S (linear attention's `StateCache`, S as [I, N, 1]):
it cannot be rewound, so prompt caching stays off (linear_attn.py), and a step continues each sequence where its
state stands. Every position takes the recurrence in f32, prompts too, as transformers' torch implementation does
(a scan whose decay differs per channel has no chunked form as Mamba-2's has). bf16 decode rows take
kernels/mamba1.c for the convolution and for the scan step with the D term and the gate; x_proj, the norms and
dt_proj run between the two calls as modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, native_mamba
from .batch import LayerKV
from .kvquant import DEFAULT, KVTypes
from .layers import Linear, RMSNorm
from .linear_attn import Conv1d, StateCache, step_states, verify_rows


def _native_linear(p) -> bool:
    """A native int8 / int4 QLinear computing in bf16 (the kernels' GEMMs take its weights)."""
    return getattr(p, "path", None) == "native" and p.compute_dtype == torch.bfloat16


@dataclass
class Mamba1Args:
    hidden: int
    inner: int  # I
    state: int  # N
    dt_rank: int  # R
    conv_kernel: int  # K
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = True  # RMSNorms of dt, B and C (Jamba's)


class Mamba1Mixer(nn.Module):
    """x [T, hidden] -> [T, hidden] over the step's sequences, each continuing its own `StateCache`."""

    _f32: dict[str, torch.Tensor] | None = None  # what the kernels take in f32 (native_f32), computed on first use

    def __init__(self, a: Mamba1Args):
        super().__init__()
        self.a = a
        self.in_proj = Linear(a.hidden, 2 * a.inner, a.proj_bias)
        self.conv1d = Conv1d(a.inner, a.conv_kernel)  # weight [I, 1, K]
        if a.conv_bias:
            self.conv1d.bias = nn.Parameter(torch.zeros(a.inner), requires_grad=False)
        self.x_proj = Linear(a.inner, a.dt_rank + 2 * a.state)
        self.dt_proj = Linear(a.dt_rank, a.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(a.inner, a.state), requires_grad=False)  # [I, N]
        self.D = nn.Parameter(torch.ones(a.inner), requires_grad=False)  # [I]
        self.out_proj = Linear(a.inner, a.hidden, a.proj_bias)
        if a.inner_norms:
            self.dt_layernorm = RMSNorm(a.dt_rank, a.eps)
            self.b_layernorm, self.c_layernorm = RMSNorm(a.state, a.eps), RMSNorm(a.state, a.eps)

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        # (a recurrent state stays in the compute dtype whatever the K/V cache types)
        a = self.a
        return StateCache(a.inner, a.conv_kernel, a.inner, a.state, 1, dtype, device)  # (ssm [I, N, 1])

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if (y := verify_rows(self.forward, x, kv)) is not None:  # (a speculative verify: linear_attn.py)
            return y
        a = self.a
        if self._native_rows(x, kv):
            return self._native(x, kv)
        u, z = self.in_proj(x).chunk(2, -1)  # [T, I] x2
        convs = []
        for r0, r1, start, cache in kv.segs:
            cache.resume(start)
            convs.append(self._conv(u[r0:r1], cache, start > 0))
        u = convs[0] if len(convs) == 1 else torch.cat(convs)  # [T, I], silu applied, x's dtype
        dt, B, C = self.x_proj(u).split([a.dt_rank, a.state, a.state], -1)
        if a.inner_norms:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.softplus(self.dt_proj(dt).float())  # [T, I]
        A = -self.A_log.float().exp()  # [I, N]
        ys = []
        for r0, r1, start, cache in kv.segs:
            ys.append(self._scan(u[r0:r1].float(), dt[r0:r1], A, B[r0:r1].float(), C[r0:r1].float(), cache))
            cache.pos = start + r1 - r0
        y = ys[0] if len(ys) == 1 else torch.cat(ys)  # [T, I] f32
        y = (y + u.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))

    def _conv(self, u: torch.Tensor, cache: StateCache, continuing: bool) -> torch.Tensor:
        """silu of the causal convolution of one sequence's rows u [n, I] after its kept inputs -> [n, I] in u's
        dtype; the last K-1 inputs kept."""
        K, n = self.a.conv_kernel, u.shape[0]
        w, bias = self.conv1d.weight, getattr(self.conv1d, "bias", None)
        seq = torch.cat([cache.conv, u.T.to(cache.conv.dtype)], -1)  # [I, K-1+n]
        if continuing:  # the taps summed in order in f32 (torch's depthwise conv1d took ~110 us a decode row)
            win = seq.unfold(1, K, 1)  # [I, n, K]
            y = torch.zeros(self.a.inner, n, device=seq.device)
            for k in range(K):
                y = y + win[..., k].float() * w[:, 0, k, None].float()
            if bias is not None:
                y = y + bias[:, None].float()
        else:  # (from zeros: the padded form transformers computes)
            y = F.conv1d(u.T[None].to(w.dtype), w, bias, padding=K - 1, groups=self.a.inner)[0, :, :n]
        cache.conv.copy_(seq[:, -(K - 1):])
        return F.silu(y).T.to(u.dtype)

    @staticmethod
    def _scan(u, dt, A, B, C, cache: StateCache) -> torch.Tensor:
        """One sequence's n positions (f32: u, dt [n, I], A [I, N], B, C [n, N]) through the recurrence from its
        state, which moves on -> y [n, I] without the D term."""
        S = cache.ssm[..., 0]  # [I, N] f32, a view
        dA = (dt[:, :, None] * A).exp()  # [n, I, N]
        dBu = dt[:, :, None] * B[:, None, :] * u[:, :, None]  # [n, I, N]
        ys = []
        for t in range(u.shape[0]):
            S.mul_(dA[t]).add_(dBu[t])
            ys.append(S @ C[t])
        return torch.stack(ys)

    def _native(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """bf16 decode rows: kernels/mamba1.c from in_proj's output to the gated output (x_proj and dt_proj in it
        when they are native QLinears; else the convolution and the scan step there, the modules between)."""
        a = self.a
        xz = self.in_proj(x).contiguous()  # [T, 2I]
        conv, ssm = step_states(kv)
        if all(_native_linear(p) for p in (self.x_proj, self.dt_proj)):
            return self.out_proj(native_mamba.mamba1_rows(self, xz, conv, ssm))
        u = native_mamba.mamba1_conv(xz, conv, self.conv1d.weight, getattr(self.conv1d, "bias", None))
        dt, B, C = self.x_proj(u).split([a.dt_rank, a.state, a.state], -1)
        if a.inner_norms:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        y = native_mamba.mamba1_scan(self.dt_proj(dt).to(torch.bfloat16).contiguous(), B.to(torch.bfloat16),
                                     C.to(torch.bfloat16), u, xz, ssm, self.native_f32("A"), self.D)
        return self.out_proj(y)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + self(in_norm(h)), post_norm(that)) in one native call (kernels/mamba1.c coli_mamba1_block) for bf16
        decode rows when all four projections are native (in_proj and out_proj without bias), with the bits of
        the layer-by-layer native path; else None."""
        if not self._native_rows(h, kv) or self.in_proj.bias is not None or self.out_proj.bias is not None \
                or not all(_native_linear(p) for p in (self.in_proj, self.x_proj, self.dt_proj, self.out_proj)) \
                or any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in (in_norm, post_norm)):
            return None
        return native_mamba.mamba1_block(self, h.contiguous(), in_norm, post_norm, *step_states(kv))

    def native_f32(self, what: str) -> torch.Tensor:
        """What the kernels take in f32, computed once (dropped when the module moves, see _apply): "A" = -exp(A_log)
        [I, N], "dt_bias" dt_proj's bias [I]."""
        if self._f32 is None:
            self._f32 = {}
        t = self._f32.get(what)
        if t is None:
            src = -self.A_log.float().exp() if what == "A" else self.dt_proj.bias.float()
            t = self._f32[what] = src.contiguous()
        return t

    def _native_rows(self, x: torch.Tensor, kv: LayerKV) -> bool:
        """Whether kernels/mamba1.c takes this step: bf16 rows on the CPU, one per sequence, each continuing its
        state, f32 parameters; the f32 oracle path and prompts stay in torch."""
        norms = (self.dt_layernorm, self.b_layernorm, self.c_layernorm) if self.a.inner_norms else ()
        params = (self.conv1d.weight, getattr(self.conv1d, "bias", None), self.A_log, self.D,
                  *(n.weight for n in norms))
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] <= native.MOE_MAX_ROWS \
            and self.a.state <= native_mamba.MAX_STATE and native.available() \
            and all(p is None or (p.dtype == torch.float32 and p.is_contiguous()) for p in params) \
            and all(r1 - r0 == 1 and start > 0 and c.conv.dtype == torch.bfloat16 and c.conv.is_contiguous()
                    and c.conv.device.type == "cpu" for r0, r1, start, c in kv.segs)

    def _apply(self, fn, recurse: bool = True):  # moved parameters: the cached A and weight pointers are stale
        self._f32 = None
        native_mamba.forget(self)
        return super()._apply(fn, recurse)
