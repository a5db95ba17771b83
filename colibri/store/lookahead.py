"""Look-ahead: predict the experts the next MoE layer will need and start reading them now.

Layer L's residual after attention `h` [T, H], put through the next MoE layer's own norm and router
(L+1's, or past the dense layers between: Llama 4 Maverick's and Jamba's alternate), names the experts
that layer's rows are likely routed to (the residual changes little in a layer or two).
The MoE layer of L calls `LookAhead(L, h)` once its own experts are claimed and their reads
started (so a prefetch never evicts what L needs now); the reads then overlap L's compute.

It works on the step's rows: one row (a single decode) predicts that token's top-k, ranked
by the router and scored per rank (ExpertCache.rank_ok turns off ranks that mispredict);
several rows (a batch or a prefill chunk) predict the union of their routes, most requested
first, read only while the top rank's predictions hold.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .experts import Experts


class LookAhead:
    """Callable `(layer, h)` bound into the MoE layers whose next layer's experts are cached."""

    def __init__(self, source: Experts, blocks: nn.ModuleList):
        self.source = source
        # MoE layer L -> (the next MoE layer N, N's norm and router, its routed experts' count), for every such N
        # with cached experts (a router may name more ids: LongCat's zero-computation experts, nothing to read)
        self.next: dict[int, tuple[int, nn.Module, nn.Module, int]] = {}
        routed = [(L, b.post_attention_layernorm, b.mlp.gate, b.mlp.experts.num_experts)
                  for L, b in enumerate(blocks) if is_routed(b)]
        for (L, *_), (N, norm, gate, n) in zip(routed, routed[1:]):
            if N in source.cached:
                self.next[L] = (N, norm, gate, n)

    def __call__(self, layer: int, h: torch.Tensor) -> None:
        nxt = self.next.get(layer)
        if nxt is None:
            return
        _, norm, gate, _ = nxt
        idx = gate(norm(h.to(gate.weight.device)))[0]  # [T, k]: the next MoE layer's routes, predicted
        self.read(layer, idx.cpu().numpy())

    def read(self, layer: int, idx: np.ndarray) -> None:
        """Start reading the experts of the MoE layer after `layer` that its routes idx [T, k] (int64), predicted
        from layer's residual (here, or by the one-call step's kernel: engine/stream_hook.py), name."""
        if idx.shape[0] == 1:
            self.read_row(layer, idx[0].tolist())
            return
        target, _, _, n = self.next[layer]
        counts = np.bincount(idx.reshape(-1))  # the union, most requested first (the cache caps how many it starts)
        order = np.argsort(-counts, kind="stable")
        self.source.prefetch(target, [e for e in order[: int((counts > 0).sum())].tolist() if e < n], False)

    def read_row(self, layer: int, ids: list[int]) -> None:
        """`read` of one row: its top-k ids, ranked (the kernel's prediction for a single decode, as a list)."""
        target, _, _, n = self.next[layer]
        self.source.prefetch(target, [e for e in ids if e < n], True)


def is_routed(block: nn.Module) -> bool:
    """Whether a decoder block routes its rows to experts through a router the look-ahead can apply."""
    return getattr(block, "post_attention_layernorm", None) is not None \
        and getattr(getattr(block, "mlp", None), "gate", None) is not None and hasattr(block.mlp, "experts")
