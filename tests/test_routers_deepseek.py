"""DeepSeek router math on hand-built weights, checked against values worked out by hand,
plus a cross-check against transformers' routers on random inputs and the dense/MoE layer plan."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from colibri.layers.layers import MLP
from colibri.layers.moe import SparseMoE
from colibri.models import deepseek_v2, deepseek_v3


def _args(module, E: int, k: int, **kw):
    return module.ModelArgs(hidden_size=E, intermediate_size=8, moe_intermediate_size=4, num_hidden_layers=1,
                            num_attention_heads=1, vocab_size=8, n_routed_experts=E, num_experts_per_tok=k,
                            **kw)


def _router(module, logits: list[float], k: int, bias: list[float] | None = None, **kw):
    """A router whose logits are exactly `logits` (identity weight, x = logits)."""
    E = len(logits)
    r = module.Router(_args(module, E, k, **kw))
    r.weight.data = torch.eye(E)
    if bias is not None:
        r.e_score_correction_bias.data = torch.tensor(bias)
    return r, torch.tensor([logits])


def _picked(idx: torch.Tensor, w: torch.Tensor) -> dict[int, float]:
    return {int(e): float(x) for e, x in zip(idx[0], w[0])}


def _softmax(xs: list[float]) -> list[float]:
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ----------------------------------------------------------------------------- V2: softmax


def test_v2_greedy_top_k_times_routed_scaling_factor():
    logits = [2.0, 0.5, 1.0, -1.0]
    r, x = _router(deepseek_v2, logits, k=2, routed_scaling_factor=1.5)
    p = _softmax(logits)
    got = _picked(*r(x))
    assert got.keys() == {0, 2}
    assert got[0] == pytest.approx(1.5 * p[0], rel=1e-6) and got[2] == pytest.approx(1.5 * p[2], rel=1e-6)


def test_v2_group_limited_greedy_excludes_a_high_scoring_expert():
    # 4 groups of 2; a group scores its best expert: g0 3.0, g1 2.9, g2 2.95, g3 -1 -> keep g0, g2.
    # Plain greedy top-3 would be e0, e4, e2; e2 (2.9) and e3 (2.8) sit in the dropped g1, so
    # the third pick is e1 (-1.5), ahead of e5 (-2.0).
    logits = [3.0, -1.5, 2.9, 2.8, 2.95, -2.0, -1.0, -1.0]
    r, x = _router(deepseek_v2, logits, k=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                   routed_scaling_factor=2.0)
    got = _picked(*r(x))
    assert got.keys() == {0, 4, 1}
    p = _softmax(logits)  # weights: softmax over all experts, masked groups included in the denominator
    for e in got:
        assert got[e] == pytest.approx(2.0 * p[e], rel=1e-6)


def test_v2_norm_topk_prob_renormalises_instead_of_scaling():
    logits = [2.0, 0.5, 1.0, -1.0]
    r, x = _router(deepseek_v2, logits, k=2, routed_scaling_factor=1.5, norm_topk_prob=True)
    p = _softmax(logits)
    got = _picked(*r(x))
    assert got[0] == pytest.approx(p[0] / (p[0] + p[2]), rel=1e-6)
    assert got[2] == pytest.approx(p[2] / (p[0] + p[2]), rel=1e-6)


# ----------------------------------------------------------------------------- V3: sigmoid + bias


def test_v3_bias_flips_selection_but_weights_use_unbiased_scores():
    # sigmoid: .731 .690 .500 .269; +bias 0.5 on e2 -> choice .731 .690 1.0 .269 -> picks {2, 0}, not {0, 1}.
    logits, bias = [1.0, 0.8, 0.0, -1.0], [0.0, 0.0, 0.5, 0.0]
    r, x = _router(deepseek_v3, logits, k=2, bias=bias, n_group=1, topk_group=1, routed_scaling_factor=2.5)
    got = _picked(*r(x))
    assert got.keys() == {0, 2}
    s0, s2 = _sigmoid(1.0), _sigmoid(0.0)
    assert got[0] == pytest.approx(2.5 * s0 / (s0 + s2), rel=1e-6)
    assert got[2] == pytest.approx(2.5 * s2 / (s0 + s2), rel=1e-6)
    r0, x0 = _router(deepseek_v3, logits, k=2, bias=[0.0] * 4, n_group=1, topk_group=1)
    assert _picked(*r0(x0)).keys() == {0, 1}


def test_v3_group_score_is_sum_of_top_two():
    # Sums of the two best sigmoids: g0 (4, -4) .982+.018 = 1.000, g1 (1.0, 0.9) 1.442,
    # g2 (0.6, 0.5) 1.268, g3 0.095: keep g1, g2, although g0 holds the best expert e0.
    # (Scored by its maximum, as V2 does, g0 would win.)
    logits = [4.0, -4.0, 1.0, 0.9, 0.6, 0.5, -3.0, -3.0]
    r, x = _router(deepseek_v3, logits, k=2, bias=[0.0] * 8, n_group=4, topk_group=2, norm_topk_prob=False,
                   routed_scaling_factor=1.0)
    got = _picked(*r(x))
    assert got.keys() == {2, 3}
    assert got[2] == pytest.approx(_sigmoid(1.0), rel=1e-6)
    assert got[3] == pytest.approx(_sigmoid(0.9), rel=1e-6)


def test_v3_bias_enters_group_scores():
    # Same logits; a +1.0 bias on e1 lifts g0's biased sum to .982 + 1.018 = 2.0 > g1 1.442 -> keep g0, g1.
    logits = [4.0, -4.0, 1.0, 0.9, 0.6, 0.5, -3.0, -3.0]
    bias = [0.0, 1.0, 0, 0, 0, 0, 0, 0]
    r, x = _router(deepseek_v3, logits, k=2, bias=bias, n_group=4, topk_group=2, norm_topk_prob=False)
    got = _picked(*r(x))
    # biased choice: e0 .982, e1 1.018, e2 .731 -> e1 and e0; weights unbiased
    assert got.keys() == {0, 1}
    assert got[1] == pytest.approx(_sigmoid(-4.0), rel=1e-6)


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_router_matches_transformers(method):
    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                           topk_method=method, n_group=4, topk_group=2, routed_scaling_factor=1.7)
    ref = DeepseekV2TopkRouter(cfg)
    ours = deepseek_v2.Router(deepseek_v2.ModelArgs.from_dict(cfg.to_dict() | {"moe_intermediate_size": 4}))
    _compare(ref, ours)


def test_v3_router_matches_transformers():
    cfg = DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = DeepseekV3TopkRouter(cfg)
    ours = deepseek_v3.Router(deepseek_v3.ModelArgs.from_dict(cfg.to_dict()))
    with torch.no_grad():
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.3)
    ours.e_score_correction_bias.data = ref.e_score_correction_bias.clone()
    _compare(ref, ours)


@pytest.mark.parametrize("method,norm,topk_group", [("greedy", False, 4), ("greedy", True, 4),
                                                    ("group_limited_greedy", False, 4),
                                                    ("group_limited_greedy", False, 2),
                                                    ("group_limited_greedy", False, 1)])
def test_v2_greedy_router_routes_natively_as_transformers(method, norm, topk_group):
    """Greedy top-k (V2-Lite), or group-limited (V2: the topk_group groups with the best expert): bf16 rows
    take the native softmax rule, weights times routed_scaling_factor, with transformers' experts and
    weights; renormalised (norm_topk_prob, which transformers' port ignores and DeepSeek's own code honours)
    as our torch rule does."""
    from colibri.kernels import native

    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    cfg = DeepseekV2Config(hidden_size=64, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                           topk_method=method, n_group=4, topk_group=topk_group, routed_scaling_factor=2.5,
                           norm_topk_prob=norm)
    ref = DeepseekV2TopkRouter(cfg)
    ours = deepseek_v2.Router(deepseek_v2.ModelArgs.from_dict(cfg.to_dict() | {"moe_intermediate_size": 4}))
    assert ours.native_routing() is not None
    if not norm:
        _compare_native(ref, ours)
        return
    ours.weight.data = torch.randn(ours.weight.shape, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    idx, w = ours(x)  # native
    ref_idx, ref_w = ours(x.float())  # torch, the same values
    assert torch.equal(idx, ref_idx) and torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.sum(-1), torch.ones(64))


@pytest.mark.parametrize("groups", [(1, 1), (4, 4), (4, 2), (8, 3)])
def test_v3_router_routes_natively_as_transformers(groups):
    """One group (Kimi-K2, Moonlight), all groups kept, or group-limited (DeepSeek-V3/R1: the topk_group groups
    with the best sum of two): bf16 rows take the native sigmoid rule, with
    transformers' experts and weights (f32 rows route in torch, the oracle's path)."""
    from colibri.kernels import native

    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    n_group, topk_group = groups
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = DeepseekV3TopkRouter(cfg)
    ours = deepseek_v3.Router(deepseek_v3.ModelArgs.from_dict(cfg.to_dict()))
    with torch.no_grad():
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.3)
    ours.e_score_correction_bias.data = ref.e_score_correction_bias.clone()
    assert ours.native_routing() is not None
    _compare_native(ref, ours)


def _compare_native(ref, ours):
    from colibri.kernels import native

    calls = []
    real = native.route
    native.route = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        _compare(ref, ours, bf16=True)
    finally:
        native.route = real
    assert calls  # (the bf16 rows went through the kernel)


def _compare(ref, ours, bf16: bool = False):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen))
    ours.weight.data = ref.weight.detach().clone()
    x = torch.randn(64, ref.weight.shape[1], generator=gen)
    if bf16:  # the same values, as the bf16 rows a decode step hands the router
        x = x.bfloat16().float()
    with torch.no_grad():
        _, ref_w, ref_idx = ref(x)
    idx, w = ours(x.bfloat16() if bf16 else x)
    # same experts and weights per token; slot order is free (the experts' sum does not depend on it)
    ref_idx, order = ref_idx.sort(-1)
    idx, mine = idx.sort(-1)
    assert torch.equal(idx, ref_idx)
    tol = (1e-5, 1e-6) if bf16 else (1e-6, 1e-7)  # (the kernel's softmax sums in its own order: float rounding)
    torch.testing.assert_close(w.gather(1, mine), ref_w.gather(1, order), rtol=tol[0], atol=tol[1])


# ----------------------------------------------------------------------------- layer plan


@pytest.mark.parametrize("module", [deepseek_v2, deepseek_v3])
def test_dense_first_layers_moe_layer_freq_and_shared_experts(module):
    a = module.ModelArgs(hidden_size=16, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=6,
                         num_attention_heads=2, vocab_size=32, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=3, first_k_dense_replace=2, moe_layer_freq=2, kv_lora_rank=8,
                         qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    model = module.Model(a)
    kinds = ["moe" if isinstance(b.mlp, SparseMoE) else "dense" for b in model.model.layers]
    assert kinds == ["dense", "dense", "moe", "dense", "moe", "dense"]
    assert model.model.layers[0].mlp.gate_proj.out_features == 40
    shared = model.model.layers[2].mlp.shared_experts
    assert isinstance(shared, MLP) and shared.gate_proj.out_features == 3 * 8
    assert isinstance(model.model.layers[2].mlp.gate, module.Router)
