"""GLM-4.5 router math on hand-built weights; expected values are worked out by hand below.

The router weight is the identity, so a token's hidden state *is* its router logits; logits are
chosen as logit(p) = ln(p / (1 - p)) so the sigmoid scores are round numbers p.
"""

from __future__ import annotations

import math

import pytest
import torch
from route_check import assert_native_routes_as_torch

from colibri.models.glm4_moe import GroupLimitedRouter


def make_router(scores: list[list[float]], bias: list[float], *, top_k: int = 2, n_group: int = 1,
                topk_group: int = 1, norm: bool = True, scale: float = 1.0):
    """A router over len(bias) experts and the hidden states [T, E] that give sigmoid scores `scores`."""
    E = len(bias)
    r = GroupLimitedRouter(E, E, top_k, n_group, topk_group, norm, scale)
    r.weight.data = torch.eye(E)
    r.e_score_correction_bias.data = torch.tensor(bias)
    x = torch.tensor([[math.log(p / (1 - p)) for p in row] for row in scores])  # [T, E]
    return r, x


def routed(r, x) -> list[dict[int, float]]:
    """{expert: weight} per token, so slot order does not matter."""
    idx, w = r(x)
    return [dict(zip(i.tolist(), ww.tolist())) for i, ww in zip(idx, w)]


def assert_routes(got: list[dict[int, float]], want: list[dict[int, float]]):
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    for g, w in zip(got, want):
        for e in w:
            assert g[e] == pytest.approx(w[e], abs=1e-6)


SCORES = [[0.9, 0.75, 0.5, 0.25]]


def test_without_bias_top2_by_score_renormalised():
    r, x = make_router(SCORES, [0.0, 0.0, 0.0, 0.0])
    # experts 0 and 1 win; 0.9 / 1.65 and 0.75 / 1.65
    assert_routes(routed(r, x), [{0: 0.9 / 1.65, 1: 0.75 / 1.65}])


def test_bias_changes_selection_but_not_weights():
    r, x = make_router(SCORES, [0.0, 0.0, 0.5, 0.0])
    # biased choice scores [0.9, 0.75, 1.0, 0.25]: experts 2 and 0 win, but they are weighted by
    # their unbiased scores 0.5 and 0.9 (renormalised over 1.4), not by 1.0 and 0.9.
    assert_routes(routed(r, x), [{2: 0.5 / 1.4, 0: 0.9 / 1.4}])


def test_no_renormalisation_then_scaling_factor():
    r, x = make_router(SCORES, [0.0, 0.0, 0.5, 0.0], norm=False, scale=2.5)
    # raw sigmoid scores times routed_scaling_factor: 0.5 * 2.5, 0.9 * 2.5
    assert_routes(routed(r, x), [{2: 1.25, 0: 2.25}])


def test_scaling_factor_applies_after_renormalisation():
    r, x = make_router(SCORES, [0.0, 0.0, 0.0, 0.0], norm=True, scale=2.5)
    # the weights sum to the scaling factor, not to 1
    assert_routes(routed(r, x), [{0: 2.5 * 0.9 / 1.65, 1: 2.5 * 0.75 / 1.65}])


# Four groups of two experts. Group strength = sum of its two best scores:
#   g0 [0.95, 0.05] -> 1.00   g1 [0.65, 0.60] -> 1.25   g2 [0.55, 0.50] -> 1.05   g3 [0.20, 0.20] -> 0.40
GROUPED = [[0.95, 0.05, 0.65, 0.60, 0.55, 0.50, 0.20, 0.20]]


def test_group_limit_excludes_the_best_single_expert():
    r, x = make_router(GROUPED, [0.0] * 8, n_group=4, topk_group=2)
    # groups g1 and g2 survive; expert 0 (0.95, the best score of all) sits in g0 and is excluded.
    # Best two of {2: .65, 3: .60, 4: .55, 5: .50}: experts 2 and 3, renormalised over 1.25.
    assert_routes(routed(r, x), [{2: 0.65 / 1.25, 3: 0.60 / 1.25}])


def test_all_groups_allowed_is_plain_top_k():
    r, x = make_router(GROUPED, [0.0] * 8, n_group=4, topk_group=4)
    assert_routes(routed(r, x), [{0: 0.95 / 1.6, 2: 0.65 / 1.6}])


def test_bias_counts_when_ranking_groups():
    r, x = make_router(GROUPED, [0.0] * 6 + [0.5, 0.5], n_group=4, topk_group=2)
    # biased g3 = [0.7, 0.7] -> 1.4 now beats g2 (1.05); the best biased experts are 6 and 7 (0.7 each),
    # weighted by their unbiased 0.2 and 0.2 -> 0.5 each after renormalisation.
    assert_routes(routed(r, x), [{6: 0.5, 7: 0.5}])


def test_each_token_routes_independently():
    second = [0.05, 0.95, 0.1, 0.1, 0.1, 0.1, 0.9, 0.3]
    r, x = make_router(GROUPED + [second], [0.0] * 8, n_group=4, topk_group=2)
    # token 2: g0 = 1.0, g3 = 1.2 survive (g1 = g2 = 0.2); experts 1 (0.95) and 6 (0.9), over 1.85
    assert_routes(routed(r, x), [{2: 0.65 / 1.25, 3: 0.60 / 1.25}, {1: 0.95 / 1.85, 6: 0.9 / 1.85}])


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3)])
def test_bf16_rows_route_natively_as_torch_does(groups):
    """bf16 rows take the kernels' sigmoid rule in its groups (kernels/route.c keep_groups): the experts and
    weights of the torch rule on the same values."""
    g = torch.Generator().manual_seed(5)
    r = GroupLimitedRouter(32, 16, 4, *groups, True, 2.5)
    r.weight.data = torch.randn(16, 32, generator=g)
    r.e_score_correction_bias.data = torch.randn(16, generator=g) * 0.3
    assert_native_routes_as_torch(r, torch.randn(64, 32, generator=g))
