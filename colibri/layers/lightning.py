"""Lightning attention (MiniMax-Text-01 / MiniMax-M1's linear-attention layers): softmax-free attention with a
per-head exponential decay, whose state S [D, D] per head stands in for a KV cache:

    S_t = exp(-s) S_{t-1} + k_t^T v_t        o_t = q_t S_t

with q, k, v = silu(qkv_proj x) split per head, and the decay rate s of head h in layer i of L:
(2^(-8/H))^(h+1) * (1 - i / (L - 1 + 1e-5) + 1e-5) (transformers' `get_slope_rate`: the last layer barely decays).
The heads' outputs are RMS-normed together, gated by sigmoid(output_gate x) and projected by out_proj.

Prompts run transformers' blocked form (`block_size` positions at a time: the block's own scores under the decay
mask, plus the decayed state; then one state update), decode rows the recurrence, both in f32 from a state that
may already hold a prefix (a chunked prompt continues where the last chunk left). bf16 decode rows of native weights
take the block's whole mixing half in one call (kernels/lightning.c, `fused`). A state cannot be rewound, so
prompt caching stays off for the model (linear_attn.py's `StateCache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, native_lightning
from .batch import LayerKV
from .kvquant import DEFAULT, KVTypes
from .layers import Linear, RMSNorm
from .linear_attn import StateCache, block_weights, forget_block_weights, step_states, verify_rows

NORM_EPS = 1e-6  # (transformers' MiniMaxRMSNorm default: the heads' norm is built without rms_norm_eps)


@dataclass
class LightningArgs:
    hidden: int
    heads: int
    head_dim: int
    block: int  # `block_size`: the prompts' block length
    layer: int
    n_layers: int


def slope_rate(heads: int, layer: int, n_layers: int) -> torch.Tensor:
    """Each head's decay rate [H, 1, 1] f32, computed as transformers' MiniMaxLightningAttention does."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return ((base ** (torch.arange(heads) + 1)) * factor)[:, None, None]


def lightning(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, slope: torch.Tensor,
              block: int) -> torch.Tensor:
    """q, k, v [H, T, D] f32 of positions continuing state S [H, D, D] f32 (updated in place) -> o [H, T, D]."""
    T = q.shape[1]
    if T == 1:  # a decode row: the recurrence
        S.mul_(torch.exp(-slope)).add_(k.transpose(1, 2) @ v)
        return q @ S
    outs = []
    for s in range(0, T, block):
        qb, kb, vb = q[:, s : s + block], k[:, s : s + block], v[:, s : s + block]  # [H, n, D]
        n = qb.shape[1]
        r = torch.arange(1, n + 1)
        q_decay = torch.exp(-slope * r[:, None])  # [H, n, 1]
        k_decay = torch.exp(-slope * (n - r)[:, None])  # [H, n, 1]
        gap = slope * (r[:, None] - r[None, :])  # [H, n, n]
        diag = torch.exp(torch.where(gap >= 0, -gap, float("-inf")))  # [H, n, n]: causal decay within the block
        intra = ((qb @ kb.transpose(1, 2)) * diag) @ vb
        inter = (qb * q_decay) @ S
        outs.append(inter + intra)
        S.mul_(torch.exp(-slope * n)).add_((kb * k_decay).transpose(1, 2) @ vb)
    return torch.cat(outs, 1)


class LightningAttention(nn.Module):
    """x [T, hidden] -> [T, hidden] over the step's sequences, each continuing its own `StateCache`."""

    def __init__(self, a: LightningArgs):
        super().__init__()
        self.a = a
        HD = a.heads * a.head_dim
        self.qkv_proj = Linear(a.hidden, 3 * HD)
        self.output_gate = Linear(a.hidden, HD)
        self.out_proj = Linear(HD, a.hidden)
        self.norm = RMSNorm(HD, NORM_EPS)
        self.register_buffer("slope", slope_rate(a.heads, a.layer, a.n_layers), persistent=False)  # [H, 1, 1]

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if (y := verify_rows(self.forward, x, kv)) is not None:  # (a speculative verify: linear_attn.py)
            return y
        a, T = self.a, x.shape[0]
        qkv = F.silu(self.qkv_proj(x)).view(T, a.heads, 3 * a.head_dim).transpose(0, 1).float()  # [H, T, 3D]
        q, k, v = qkv.split(a.head_dim, -1)  # [H, T, D] each
        outs = []
        for r0, r1, start, cache in kv.segs:
            cache.resume(start)
            outs.append(lightning(q[:, r0:r1], k[:, r0:r1], v[:, r0:r1], cache.ssm, self.slope, a.block))
            cache.pos = start + r1 - r0
        o = torch.cat(outs, 1).transpose(0, 1).reshape(T, -1).to(x.dtype)  # [T, H*D]
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * self.norm(o))

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        # (a recurrent state stays in the compute dtype whatever the K/V cache types)
        return StateCache(0, 2, self.a.heads, self.a.head_dim, self.a.head_dim, dtype, device)

    @property
    def slope_flat(self) -> torch.Tensor:
        return self.slope.view(-1)  # [H] (the buffer is contiguous)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm: RMSNorm, post_norm: RMSNorm, alpha: float, beta: float
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(alpha x + beta self(x), post_norm of that) with x = in_norm(h), in one native call (kernels/lightning.c)
        for bf16 CPU decode rows (one a sequence) of native projections; None where it does not apply."""
        a = self.a
        if h.dtype != torch.bfloat16 or h.device.type != "cpu" or h.shape[0] > native.MOE_MAX_ROWS \
                or a.head_dim > native_lightning.MAX_D or any(r1 - r0 != 1 for r0, r1, _, _ in kv.segs) \
                or not native.available() or self.norm.weight.dtype != torch.float32 \
                or self.slope.dtype != torch.float32:
            return None
        w = block_weights(self, (self.qkv_proj, self.output_gate, self.out_proj), in_norm, post_norm)
        if w is None:
            return None
        _, ssm = step_states(kv)
        p = self.qkv_proj
        return native_lightning.lightning_block(self, 8 if p.scheme == "int8" else 4, p.group_size, w,
                                                h.contiguous(), in_norm, post_norm, alpha, beta, ssm)

    def _apply(self, fn, recurse: bool = True):  # moved weights: the block's pointers go
        forget_block_weights(self)
        return super()._apply(fn, recurse)
