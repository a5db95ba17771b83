"""Re-quantizing weights that were quantized already (a packed-int checkpoint) without rounding them twice.

A group scheme stores w = q * scale + min, q in 0..qmax, per group of inputs. Weights dequantized from
another int grid (Kimi-K2-Thinking's symmetric int4 experts: k * s, k in -8..7) fit such a group exactly when
min is the group's smallest value and scale the grid's step -- which min/max scaling only finds when the
group uses every level. `on_grid` finds the step (the smallest gap between the group's values) and keeps
it where it reproduces every value.
"""

from __future__ import annotations

import torch
from torch import Tensor


def on_grid(wg: Tensor, mn: Tensor, q: Tensor, scale: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Groups whose values already lie on a grid min + k * d (k <= qmax; d their smallest gap), e.g. a
    symmetric int4 checkpoint's q * s (Kimi-K2-Thinking) that does not span all 16 levels, take that grid:
    stored exactly instead of rounded a second time. Any other group keeps (q, scale). wg [out, G, g] f32,
    mn / scale f16 [out, G], q [out, G, g]."""
    gaps = wg.sort(dim=-1).values.diff(dim=-1)  # [out, G, g - 1]
    d = torch.where(gaps > 0, gaps, torch.inf).amin(dim=-1).to(torch.float16)  # [out, G]
    d32 = d.float()
    ok = torch.isfinite(d32) & (d32 > 0)
    safe = torch.where(ok, d32, 1.0)[..., None]
    qd = torch.round((wg - mn.float()[..., None]) / safe)
    exact = ok & (qd <= qmax).all(-1) & (qd * safe + mn.float()[..., None] == wg).all(-1)  # [out, G]
    if not exact.any():
        return q, scale
    return torch.where(exact[..., None], qd, q), torch.where(exact, d, scale)
