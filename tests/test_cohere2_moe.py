"""Command A MoE (cohere2_moe): the layer patterns and the RoPE rule as transformers decides them, the tied and scaled
head the releases have, both router functions, both shared-expert combinations, the RMSNorm variant, refusals by
name. Its oracle, batch, prompt-cache and tier tests run with every family's (tests/tiny_configs.py: a dense prefix
layer, a sliding layer, a full layer without RoPE, a shared expert averaged in, the head scaled)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_greedy_with_logits, hf_logits, load_hf, tiny_config_kwargs
from route_check import assert_native_routes_as_torch
from transformers import Cohere2MoeConfig

import colibri
from colibri.errors import ColibriError
from colibri.models.base import build
from colibri.models.cohere2_moe import ModelArgs, check_config, router

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "cohere2_moe", **tiny_config_kwargs("cohere2_moe"), **over}


@pytest.mark.parametrize("over", [{}, {"first_k_dense_replace": 2, "sliding_window_pattern": 3},
                                  {"first_k_dense_replace": 3, "prefix_dense_sliding_window_pattern": 2},
                                  {"first_k_dense_replace": 0, "sliding_window_pattern": 4}])
def test_layer_patterns_and_rope_are_transformers(over: dict) -> None:
    """A release config's `first_k_dense_replace` and patterns give transformers' lists, and RoPE where its
    attention applies it (sliding layers; dense ones while the prefix pattern is 1)."""
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeAttention

    kw = {**tiny_config_kwargs("cohere2_moe"), "num_hidden_layers": 9, **over}
    ref = Cohere2MoeConfig(**kw)
    a = ModelArgs.from_dict({"model_type": "cohere2_moe", **kw})
    assert (a.layer_types, a.mlp_layer_types) == (ref.layer_types, ref.mlp_layer_types)
    for i in range(9):
        t = Cohere2MoeAttention(ref, i)
        assert a.rotates(i) == (t.sliding_window is not None or t.force_rope), i
    model, _ = build("cohere2_moe", kw)
    assert all(b.parallel and b.post_attention_layernorm is b.input_layernorm for b in model.model.layers)
    assert [b.self_attn.a.positions.use_rope for b in model.model.layers] == [a.rotates(i) for i in range(9)]


@pytest.mark.parametrize("over", [
    {"tie_word_embeddings": True, "logit_scale": 0.0625},  # (as released: the head is the embedding, scaled)
    {"expert_selection_fn": "sigmoid", "shared_expert_combination_strategy": "sum"},
    {"expert_selection_fn": "sigmoid", "norm_topk_prob": False, "num_shared_experts": 0},
    {"rms_norm_eps": 1e-5}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    hf = load_hf(ckpt.hf("cohere2_moe", **over))
    ref = hf_logits(hf, PROMPT * 3)  # 36 positions: past the sliding window of 8
    with colibri.load(ckpt.coli("cohere2_moe", "f32", **over), ctx_size=64, threads=2) as llm:
        got = llm.logits(PROMPT * 3).float()
        assert (got - ref).abs().max() < 1e-4
        want, _ = hf_greedy_with_logits(hf, PROMPT, 8)
        assert list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True)) == want


@pytest.mark.parametrize("fn,norm", [("softmax", True), ("sigmoid", True), ("sigmoid", False)])
def test_the_router_rules_in_torch_and_the_kernels(fn: str, norm: bool) -> None:
    """The top k logits weighted by their softmax or their (renormalised) sigmoids, times the "average" half; the
    kernels' rule on bf16 rows gives the same experts and weights."""
    g = torch.Generator().manual_seed(3)
    r = router(32, 16, 4, fn, norm, 0.5)
    r.weight.data = torch.randn(16, 32, generator=g)
    x = torch.randn(64, 32, generator=g).bfloat16().float()
    idx, w = assert_native_routes_as_torch(r, x)
    top, order = (x @ r.weight.T).topk(4, -1)
    assert torch.equal(idx, order)
    want = top.softmax(-1) if fn == "softmax" else top.sigmoid() / (top.sigmoid().sum(-1, keepdim=True) if norm else 1)
    torch.testing.assert_close(w, want * 0.5)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),  # one short
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"expert_selection_fn": "sparsemixer"}, "expert_selection_fn"),
    ({"shared_expert_combination_strategy": "gated"}, "shared_expert_combination_strategy"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))
