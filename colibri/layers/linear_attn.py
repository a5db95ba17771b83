"""Gated DeltaNet (Qwen3-Next's linear-attention layers): a causal depthwise convolution over q/k/v, then
the gated delta rule, whose per-head state S [Dk, Dv] stands in for a KV cache:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T      o_t = S_t^T q_t

with q, k L2-normalised (q also scaled by Dk^-1/2), beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias).
A sequence's state is a fixed size whatever its length (`StateCache`), so a slot holds it instead of K/V
positions. Prompts run the chunked form (64 tokens at a time: a triangular solve per chunk, then one state
update), decode steps the recurrence itself; both in f32, as transformers' torch implementation does.

A state cannot be rewound: it is the whole past. So a step must continue a sequence exactly where its state
stands (a prompt restarts it at position 0), and prefix reuse between requests does not apply (the engine
turns prompt caching off for such models; saved slots are refused). A speculative verify (engine/speculative.py)
is the one step that goes back: its rows run one position at a time (`verify_rows`), the state kept after each,
and the rejected rows are undone by restoring the state after the last accepted one (`StateCache.rollback`).
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ColibriError
from ..kernels import native, native_delta
from .batch import LayerKV
from .kvquant import DEFAULT, KVTypes
from .layers import Linear

CHUNK = 64


@dataclass
class DeltaArgs:
    hidden: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float
    split: bool = False  # four input projections (Qwen3.5), not two (Qwen3-Next)


class StateCache:
    """One sequence's state in one linear-attention layer: the convolution's last inputs and the delta rule's
    matrices. `pos`: the positions it has taken in."""

    POS_DIM = 0

    def __init__(self, conv_dim: int, kernel: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.conv = torch.zeros(conv_dim, kernel - 1, dtype=dtype, device=device)  # [C, K-1]
        self.ssm = torch.zeros(heads, k_dim, v_dim, dtype=torch.float32, device=device)  # [Hv, Dk, Dv]
        self.pos = 0
        # during a verify step: the (conv, ssm) after each of its rows but the last; None: not verifying
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def parts(self) -> dict[str, torch.Tensor]:
        return {}  # (nothing indexed by position: engine/kv.py copies and saves none of it)

    def to(self, device: torch.device | str) -> StateCache:
        self.conv, self.ssm = self.conv.to(device), self.ssm.to(device)
        return self

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def rollback(self, kept: int) -> None:
        """After a verify of n rows from position pos - n: keep the state after its first `kept` (1..n) rows."""
        snaps, self.snapshots = self.snapshots, None
        if snaps and kept <= len(snaps):
            conv, ssm = snaps[kept - 1]
            self.conv.copy_(conv)
            self.ssm.copy_(ssm)
            self.pos -= len(snaps) + 1 - kept

    def resume(self, start: int) -> None:
        """Ready the state for positions from `start`: 0 starts afresh, else it must be where the state is."""
        if start == 0:
            self.conv.zero_()
            self.ssm.zero_()
            self.pos = 0
        elif start != self.pos:
            raise ColibriError(f"a linear-attention state holds {self.pos} positions; a step cannot continue "
                               f"from position {start} (its state cannot be rewound)")


def verify_rows(forward, x: torch.Tensor, kv: LayerKV) -> torch.Tensor | None:
    """A state layer's output for a verify step's rows x [T, hidden]: one position of every sequence at a time
    through `forward` (the layer's own), so each row gets the recurrence plain decoding gives it (not the chunked
    form of a prompt), every sequence whose cache asks for them keeping its state after each of its rows but the
    last (`StateCache.snapshots`). None where this is no verify (no sequence of several rows asks)."""
    segs = kv.segs
    if not any(c.snapshots is not None and r1 - r0 > 1 for r0, r1, _, c in segs):
        return None
    out = None
    for i in range(max(r1 - r0 for r0, r1, _, _ in segs)):
        live = [(r0 + i, start + i, c, r0 + i + 1 < r1) for r0, r1, start, c in segs if r0 + i < r1]
        rows = [r for r, *_ in live]
        pos = live[0][1] if len(live) == 1 else torch.tensor([p for _, p, _, _ in live])
        y = forward(x[rows], LayerKV([(j, j + 1, p, c) for j, (_, p, c, _) in enumerate(live)], pos))
        if out is None:
            out = y.new_empty(x.shape[0], *y.shape[1:])
        out[rows] = y
        for _, _, c, more in live:
            if more and c.snapshots is not None:
                c.snapshots.append((c.conv.clone(), c.ssm.clone()))
    return out


def step_states(kv: LayerKV) -> tuple[list[int], list[int]]:
    """For a step of one decode row a sequence: each row's conv and ssm state pointers (for the kernels), the states
    checked to continue and then counted one position on."""
    conv, ssm = [], []
    for _, _, start, cache in kv.segs:
        cache.resume(start)
        cache.pos = start + 1
        conv.append(cache.conv.data_ptr())
        ssm.append(cache.ssm.data_ptr())
    return conv, ssm


# per state layer: its projections' weight pointers for the whole native block, beside the layer, gone with it
_BLOCK_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, ctypes.Array] = weakref.WeakKeyDictionary()


def block_weights(m: nn.Module, projs: tuple, in_norm: nn.Module, post_norm: nn.Module) -> ctypes.Array | None:
    """The projections' weight pointers for a state layer's whole native block (coli_delta_block, coli_conv_block,
    coli_mamba_block), kept for `m` until it moves (its `_apply` calls forget_block_weights): None unless every
    projection is a native bf16 QLinear without a bias, of the first one's scheme and group size, and both norms'
    weights f32 contiguous."""
    first = projs[0]
    if not all(getattr(p, "path", None) == "native" and (p.scheme, p.group_size) == (first.scheme, first.group_size)
               and p.compute_dtype == torch.bfloat16 and p.bias is None for p in projs) \
            or any(n.weight.dtype != torch.float32 or not n.weight.is_contiguous() for n in (in_norm, post_norm)):
        return None
    w = _BLOCK_WEIGHTS.get(m)
    if w is None:
        w = _BLOCK_WEIGHTS[m] = (native.QW * len(projs))(*(native.QW(*native.qw(p)) for p in projs))
    return w


def forget_block_weights(m: nn.Module) -> None:
    """Drop `m`'s block weight pointers (its weights moved)."""
    _BLOCK_WEIGHTS.pop(m, None)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_step(q, k, v, g, beta, S: torch.Tensor) -> torch.Tensor:
    """One position: q, k [H, Dk], v [H, Dv], g, beta [H] (f32, q/k normalised and q scaled); S [H, Dk, Dv]
    is updated in place. Returns o [H, Dv]."""
    S.mul_(g.exp()[:, None, None])
    mem = (S * k[:, :, None]).sum(-2)  # [H, Dv]: what the state recalls for k
    S.add_(k[:, :, None] * ((v - mem) * beta[:, None])[:, None, :])
    return (S * q[:, :, None]).sum(-2)


def delta_chunked(q, k, v, g, beta, S: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """n positions at once, `chunk` at a time: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H] (f32, as
    delta_step's); S [H, Dk, Dv] updated in place. Returns o [n, H, Dv].

    Inside a chunk with cumulative log-decay c_t, the updates form a unit lower-triangular system
    (I + tril(beta k k^T * exp(c_i - c_j), -1)) U = beta v, (likewise W for beta k exp(c)); then
    v' = U - W S, o = (q exp(c)) S + tril(q k^T * exp(c_i - c_j)) v', S <- exp(c_last) S + (k exp(c_last - c))^T v'."""
    n, H = q.shape[:2]
    pad = -n % chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))  # [H, N, D]
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(0, 1) for t in (g, beta))  # [H, N]
    N = n + pad
    q, k, v = (t.reshape(H, N // chunk, chunk, t.shape[-1]) for t in (q, k, v))  # [H, C, L, D]
    g, beta = (t.reshape(H, N // chunk, chunk) for t in (g, beta))  # [H, C, L]
    c = g.cumsum(-1)  # [H, C, L]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, C, L, L]
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # (its diagonal is ignored: unit triangular)
    U = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # [H, C, L, Dv]
    W = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, C, L, L]
    qd = q * c.exp()[..., None]
    kd = k * (c[..., -1:] - c).exp()[..., None]
    last = c[..., -1].exp()  # [H, C]
    out = torch.empty_like(U)
    for i in range(N // chunk):
        vn = U[:, i] - W[:, i] @ S  # [H, L, Dv]
        out[:, i] = qd[:, i] @ S + attn[:, i] @ vn
        S.mul_(last[:, i, None, None]).add_(kd[:, i].transpose(-1, -2) @ vn)
    return out.reshape(H, N, -1)[:, :n].transpose(0, 1)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times silu(z) (z: the layer's gate projection)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


class Conv1d(nn.Module):
    """Holds the depthwise convolution's weight [C, 1, K] under its checkpoint name."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """x [T, hidden] -> [T, hidden] over the step's sequences, each continuing its own `StateCache`.

    The input projections give, per row, the convolution's channels in order (every q head, every k head,
    every v head: qkv [C]), the gates z [Hv * Dv], then b and a [Hv] each: as one `in_proj_qkvz` and one
    `in_proj_ba` (Qwen3-Next, whose grouped rows the converter puts in this order: `grouped_rows`) or as
    four (`split`: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""

    def __init__(self, a: DeltaArgs):
        super().__init__()
        self.a = a
        kd, vd = a.k_heads * a.k_dim, a.v_heads * a.v_dim
        self.conv_dim = 2 * kd + vd
        if a.split:
            self.in_proj_qkv = Linear(a.hidden, 2 * kd + vd)
            self.in_proj_z = Linear(a.hidden, vd)
            self.in_proj_b = Linear(a.hidden, a.v_heads)
            self.in_proj_a = Linear(a.hidden, a.v_heads)
        else:
            self.in_proj_qkvz = Linear(a.hidden, 2 * kd + 2 * vd)
            self.in_proj_ba = Linear(a.hidden, 2 * a.v_heads)
        self.conv1d = Conv1d(self.conv_dim, a.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(a.v_heads), requires_grad=False)  # [Hv]
        self.A_log = nn.Parameter(torch.zeros(a.v_heads), requires_grad=False)  # [Hv]
        self.norm = GatedRMSNorm(a.v_dim, a.eps)
        self.out_proj = Linear(vd, a.hidden)

    def projections(self) -> tuple[Linear, ...]:
        if self.a.split:
            return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        return self.in_proj_qkvz, self.in_proj_ba

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv [T, C], z [T, Hv * Dv], b [T, Hv], a [T, Hv]) of the rows x, in x's dtype (views where fused)."""
        if self.a.split:
            return tuple(p(x) for p in self.projections())
        C, nv = self.conv_dim, self.a.v_heads
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        return qkvz[:, :C], qkvz[:, C:], ba[:, :nv], ba[:, nv:]

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        # (a recurrent state stays in the compute dtype whatever the K/V cache types)
        a = self.a
        return StateCache(self.conv_dim, a.conv_kernel, a.v_heads, a.k_dim, a.v_dim, dtype, device)

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if (y := verify_rows(self.forward, x, kv)) is not None:
            return y
        a, T = self.a, x.shape[0]
        parts = self.project(x)
        if self._native_rows(x, kv):  # bf16 decode rows: conv, delta rule and gated norm in one call
            for _, _, start, cache in kv.segs:
                cache.resume(start)
            o = native_delta.delta_rows(
                (a.k_heads, a.v_heads, a.k_dim, a.v_dim, a.conv_kernel), parts,
                [c.conv.data_ptr() for *_, c in kv.segs], [c.ssm.data_ptr() for *_, c in kv.segs],
                self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, a.eps)
            for _, _, start, cache in kv.segs:
                cache.pos = start + 1
            return self.out_proj(o)
        mixed, z, b, gate_a = parts
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(gate_a.float() + self.dt_bias.float())
        outs = []
        for r0, r1, start, cache in kv.segs:
            cache.resume(start)
            outs.append(self._sequence(mixed[r0:r1], beta[r0:r1], g[r0:r1], cache, start > 0))
            cache.pos = start + r1 - r0
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, Hv, Dv]
        o = self.norm(o.to(x.dtype), z.reshape(T, a.v_heads, a.v_dim))
        return self.out_proj(o.reshape(T, -1))

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + self(in_norm(h)), post_norm(that)) in one native call (kernels/delta.c coli_delta_block) for
        bf16 decode rows of native weights, with the bits of the layer-by-layer native path; else None."""
        projs = (*self.projections(), self.out_proj)
        if not self._native_rows(h, kv) or (w := block_weights(self, projs, in_norm, post_norm)) is None:
            return None
        first, a = projs[0], self.a
        for _, _, start, cache in kv.segs:
            cache.resume(start)
        out = native_delta.delta_block(
            (a.k_heads, a.v_heads, a.k_dim, a.v_dim, a.conv_kernel), 8 if first.scheme == "int8" else 4,
            first.group_size, len(projs) - 1, w, h.contiguous(), in_norm, post_norm,
            [c.conv.data_ptr() for *_, c in kv.segs], [c.ssm.data_ptr() for *_, c in kv.segs], self.conv1d.weight,
            self.A_log, self.dt_bias, self.norm.weight, a.eps)
        for _, _, start, cache in kv.segs:
            cache.pos = start + 1
        return out

    def _apply(self, fn, recurse: bool = True):  # moved weights: the fused call's pointers are stale
        forget_block_weights(self)
        return super()._apply(fn, recurse)

    def _native_rows(self, x: torch.Tensor, kv: LayerKV) -> bool:
        """Whether kernels/delta.c takes this step: bf16 rows on the CPU, one per sequence, each continuing its
        state (a prompt takes the chunked form in torch), f32 weights; the f32 oracle path stays in torch."""
        a = self.a
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[0] > native.MOE_MAX_ROWS \
                or max(a.k_dim, a.v_dim) > native_delta.MAX_DIM or not native.available():
            return False
        params = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
        if any(p.dtype != torch.float32 or not p.is_contiguous() for p in params):
            return False
        return all(r1 - r0 == 1 and start > 0 and c.conv.dtype == torch.bfloat16 and c.conv.is_contiguous()
                   and c.conv.device.type == "cpu" for r0, r1, start, c in kv.segs)

    def _sequence(self, x: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, cache: StateCache,
                  decoding: bool) -> torch.Tensor:
        """One sequence's n rows x [n, C] -> o [n, Hv, Dv] (f32), its state moved on by n positions. A row that
        continues a sequence takes the recurrence, a prompt the chunked form (transformers' choice: the same
        rounding)."""
        a, n = self.a, x.shape[0]
        K = a.conv_kernel
        seq = torch.cat([cache.conv, x.T.to(cache.conv.dtype)], -1)  # [C, K-1+n]: the kept inputs first
        cache.conv.copy_(seq[:, -(K - 1):])
        w = self.conv1d.weight
        if decoding:
            y = F.conv1d(seq[None].to(w.dtype), w, groups=self.conv_dim)[0]  # [C, n]
        else:  # (from zeros: the padded form transformers computes, to the last bit)
            y = F.conv1d(x.T[None].to(w.dtype), w, padding=K - 1, groups=self.conv_dim)[0, :, :n]
        y = F.silu(y).T  # [n, C]
        kd = a.k_heads * a.k_dim
        q, k, v = y.float().split([kd, kd, a.v_heads * a.v_dim], -1)
        r = a.v_heads // a.k_heads
        q = l2norm(q.view(n, a.k_heads, a.k_dim)).repeat_interleave(r, 1) * a.k_dim**-0.5  # [n, Hv, Dk]
        k = l2norm(k.view(n, a.k_heads, a.k_dim)).repeat_interleave(r, 1)
        v = v.view(n, a.v_heads, a.v_dim)
        if n == 1 and decoding:
            return delta_step(q[0], k[0], v[0], g[0], beta[0], cache.ssm)[None]
        return delta_chunked(q, k, v, g, beta, cache.ssm)


def grouped_rows(k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row orders that take Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head ([q, k, its r value
    heads' v, their z] and [its r b, its r a]), to GatedDeltaNet's (every q, every k, every v, every z; every
    b, every a): new row i is old row order[i]."""
    r = v_heads // k_heads
    G = 2 * k_dim + 2 * r * v_dim
    gi = torch.arange(k_heads)[:, None]
    d, e, j = torch.arange(k_dim)[None], torch.arange(v_dim), torch.arange(r)
    q = (gi * G + d).flatten()
    k = (gi * G + k_dim + d).flatten()
    vz = gi[:, :, None] * G + 2 * k_dim + j[None, :, None] * v_dim + e[None, None]  # [nk, r, dv]
    v, z = vz.flatten(), (vz + r * v_dim).flatten()
    ba = (gi * 2 * r + j[None]).flatten()
    return torch.cat([q, k, v, z]), torch.cat([ba, ba + r])
