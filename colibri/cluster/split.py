"""Which node holds which layers: contiguous ranges in proportion to the nodes' budgets, and a stage's tiers.

Pure functions of the container's sizes (store/sizes.py) and the budgets: `colibri plan --cluster` and the head
compute the same split.
"""

from __future__ import annotations

from ..errors import ColibriError
from ..store.placement import Placement
from ..store.sizes import ModelSizes

# A disk layer's expert cache below this many experts per top-k does not keep a step's experts (store/tiered.py).
MIN_CACHE_TOPK = 2


def layer_bytes(s: ModelSizes) -> list[int]:
    """What each layer holds in RAM when nothing of it streams: dense weights and routed experts."""
    return [s.layer_dense_bytes[i] + s.layer_experts_bytes(i) for i in range(s.n_layers)]


def split(weights: list[int], budgets: list[int]) -> list[tuple[int, int]]:
    """Layers [0, len(weights)) cut into len(budgets) contiguous ranges [lo, hi), each range's share of the summed
    `weights` (a layer's bytes) as near as layer boundaries allow to its node's share of the budgets. Every stage
    gets at least one layer."""
    n, k = len(weights), len(budgets)
    if k < 1 or n < k:
        raise ColibriError(f"{k} cluster stages for a model of {n} layers: each stage needs a layer")
    if any(b <= 0 for b in budgets):
        raise ColibriError(f"cluster stage budgets must be positive, got {budgets}")
    total, scale = sum(weights) or n, sum(budgets)
    cum = [0]
    for w in weights:
        cum.append(cum[-1] + (w if sum(weights) else 1))
    cuts, want = [0], 0.0
    for j in range(k - 1):
        want += budgets[j] / scale * total
        lo = cuts[-1] + 1  # at least one layer for this stage, and one left for each stage after it
        hi = n - (k - 1 - j)
        cut = min(range(lo, hi + 1), key=lambda c: (abs(cum[c] - want), c))
        cuts.append(cut)
    cuts.append(n)
    return [(cuts[j], cuts[j + 1]) for j in range(k)]


def stage_placement(s: ModelSizes, lo: int, hi: int, budget: int | None) -> Placement:
    """Tiers for a stage holding layers [lo, hi) under `budget` bytes of weights: every layer's experts resident
    where they fit, else the first layers resident while what is left still gives the rest an expert cache of
    MIN_CACHE_TOPK x top-k experts each, and the rest streamed from disk (the layers outside the range: "ram",
    unused: the store binds none of them)."""
    tiers = ["ram"] * s.n_layers
    if budget is None:
        return Placement(tiers)
    held = range(lo, hi)
    used = sum(s.layer_dense_bytes[i] for i in held)
    for n, i in enumerate(held):
        if not s.n_experts[i]:
            continue
        rest = [j for j in held[n + 1:] if s.n_experts[j]]
        cache = sum(min(s.n_experts[j], MIN_CACHE_TOPK * s.top_k) * s.expert_bytes[j] for j in rest)
        if used + s.layer_experts_bytes(i) + cache <= budget:
            used += s.layer_experts_bytes(i)
        else:
            tiers[i] = "disk"
            for j in rest:
                tiers[j] = "disk"
            break
    return Placement(tiers, mem_budget=budget)
