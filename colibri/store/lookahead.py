"""Look-ahead: predict the experts the next MoE layer will need and start reading them now.

Layer L's residual after attention `h` [T, H], put through layer L+1's own norm and router,
names the experts L+1's rows are likely routed to (the residual changes little in one layer).
The MoE layer of L calls `LookAhead(L, h)` once its own experts are claimed and their reads
started (so a prefetch never evicts what L needs now); the reads then overlap L's compute.

It works on the step's rows: one row (a single decode) predicts that token's top-k, ranked
by the router and scored per rank (ExpertCache.rank_ok turns off ranks that mispredict);
several rows (a batch or a prefill chunk) predict the union of their routes, most requested
first, read only while the top rank's predictions hold.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import Experts


class LookAhead:
    """Callable `(layer, h)` bound into the MoE layers whose next layer's experts are cached."""

    def __init__(self, source: Experts, blocks: nn.ModuleList):
        self.source = source
        # layer L -> (norm, router) of layer L + 1, for every L + 1 with cached experts
        self.next: dict[int, tuple[nn.Module, nn.Module]] = {}
        for L in range(len(blocks) - 1):
            nxt = blocks[L + 1]
            norm, gate = getattr(nxt, "post_attention_layernorm", None), getattr(nxt.mlp, "gate", None)
            if L + 1 in source.cached and norm is not None and gate is not None:
                self.next[L] = (norm, gate)

    def __call__(self, layer: int, h: torch.Tensor) -> None:
        nxt = self.next.get(layer)
        if nxt is None:
            return
        norm, gate = nxt
        idx = gate(norm(h.to(gate.weight.device)))[0]  # [T, k]: the next layer's routes, predicted
        if idx.shape[0] == 1:
            ids, track = idx[0].tolist(), True
        else:  # the union, most requested first (the cache caps how many it starts)
            counts = torch.bincount(idx.reshape(-1))
            order = torch.argsort(counts, descending=True, stable=True)
            ids, track = order[: int((counts > 0).sum())].tolist(), False
        self.source.prefetch(layer + 1, ids, track)
