"""A.X K2 (axk2): the variants the tiny model (A.X-K2-Light's shape: no router groups) does not take (grouped
routing, MoE layers from the legacy `first_k_dense_replace` / `moe_layer_freq`) against transformers' logits and
greedy tokens; the router's 0.0 mask and the gated norm against transformers' modules; names; refusals. Its oracle,
batch, tier, prompt-cache and kernel-accuracy tests run with every family's (tests/tiny_configs.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import edited_copy, hf_logits, load_hf, tiny_config_kwargs
from oracle_check import matches_transformers

import colibri
from colibri.errors import ColibriError
from colibri.models import axk2
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "axk2", **tiny_config_kwargs("axk2"), **over}


@pytest.mark.parametrize("over", [
    {"n_group": 2, "topk_group": 1},  # (the larger releases' grouped routing)
    {"mlp_layer_types": ["dense", "sparse", "dense"], "index_topk": 4}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "axk2", over, PROMPT)


def test_legacy_layer_fields_read_as_transformers_reads_them(ckpt, tmp_path) -> None:
    """A config with `first_k_dense_replace` / `moe_layer_freq` instead of `mlp_layer_types` (what
    AXK2Config converts from) gives transformers' layer kinds and its logits."""
    from transformers import AXK2Config

    from colibri.convert import convert

    over = {"mlp_layer_types": ["sparse", "dense", "sparse"]}  # (= first_k_dense_replace 0, moe_layer_freq 2)
    src = ckpt.hf("axk2", **over)
    legacy = edited_copy(src, tmp_path / "legacy", drop=("mlp_layer_types",), first_k_dense_replace=0,
                         moe_layer_freq=2)
    cfg = json.loads((legacy / "config.json").read_text())
    assert axk2.mlp_kinds(cfg, 3) == AXK2Config(num_hidden_layers=3, first_k_dense_replace=0,
                                                moe_layer_freq=2).mlp_layer_types == over["mlp_layer_types"]
    with colibri.load(convert(legacy, tmp_path / "m.coli", "f32", progress=False), ctx_size=64, threads=2) as llm:
        assert [type(b.post_attention_layernorm).__name__ for b in llm.model.model.layers] == [
            "GatedRMSNorm", "RMSNorm", "GatedRMSNorm"]
        assert (llm.logits(PROMPT * 3).float() - hf_logits(load_hf(src), PROMPT * 3)).abs().max() < 1e-4


def test_grouped_routing_masks_the_other_groups_with_zero() -> None:
    """Where the kept groups' experts score below 0 for the choice (negative selection biases), transformers'
    router takes experts of the dropped groups (masked to 0.0, not -inf): ours picks the same experts and weights,
    and DeepSeek-V3's rule would not (so the case is real)."""
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    from colibri.models import deepseek_v3 as v3

    cfg = AXK2Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     num_hidden_layers=1)
    g = torch.Generator().manual_seed(0)
    theirs = AXK2TopkRouter(cfg)
    theirs.weight.data = torch.randn(8, 16, generator=g) * 0.1
    theirs.e_score_correction_bias.data = torch.tensor([-0.9, -0.9, -0.9, 0.3, -0.9, -0.9, -0.9, -0.8])
    args = axk2.ModelArgs.from_dict(_cfg(hidden_size=16, n_routed_experts=8, n_group=2, topk_group=1))
    ours, plain = axk2.Router(args), v3.Router(args)
    for r in (ours, plain):
        r.weight.data, r.e_score_correction_bias.data = theirs.weight.data, theirs.e_score_correction_bias.data
    assert ours.native_routing() is None  # (the kernels' rule drops the other groups)
    x = torch.randn(6, 16, generator=g)
    _, w_want, i_want = theirs(x)
    i_got, w_got = ours(x)
    assert torch.equal(i_got.sort(-1).values, i_want.sort(-1).values.long())
    torch.testing.assert_close(w_got.gather(1, i_got.argsort(-1)), w_want.gather(1, i_want.long().argsort(-1)))
    assert not torch.equal(plain(x)[0].sort(-1).values, i_got.sort(-1).values)


def test_the_gated_norm_is_transformers() -> None:
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2GatedRMSNorm

    theirs = AXK2GatedRMSNorm(AXK2Config(hidden_size=16, gated_norm_rank=4, num_hidden_layers=1))
    ours = axk2.GatedRMSNorm(16, 4, theirs.norm.variance_epsilon)
    g = torch.Generator().manual_seed(1)
    for p in theirs.parameters():
        p.data = torch.randn(p.shape, generator=g)
    ours.norm.weight.data = theirs.norm.weight.data
    for mine, hf in ((ours.W_down, theirs.mlp.fc1), (ours.W_up, theirs.mlp.fc2)):
        mine.forward = hf.forward  # (placeholders until a store binds them: transformers' own linears)
    x = torch.randn(5, 16, generator=g)
    torch.testing.assert_close(ours(x), theirs(x))


def test_release_names_are_canonical_and_transformers_names_map_to_them() -> None:
    pairs = {"model.layers.0.self_attn.q_gate_proj.weight": "model.layers.0.self_attn.q_b_proj.weight",
             "model.layers.0.self_attn.q_b_proj.weight": "model.layers.0.self_attn.q_b_proj.weight",
             "model.layers.0.input_layernorm.mlp.fc1.weight": "model.layers.0.input_layernorm.W_down.weight",
             "model.layers.1.post_attention_layernorm.mlp.fc2.weight":
                 "model.layers.1.post_attention_layernorm.W_up.weight",
             "model.layers.1.input_layernorm.W_up.weight": "model.layers.1.input_layernorm.W_up.weight",
             "model.layers.1.mlp.shared_experts.up_proj.weight": "model.layers.1.mlp.shared_experts.up_proj.weight",
             "model.layers.1.self_attn.indexer.wq_b.weight": "model.layers.1.self_attn.indexer.wq_b.weight"}
    assert {k: axk2.sanitize(k) for k in pairs} == pairs
    model, _ = build("axk2", _cfg())
    names = {n for n, _ in model.named_modules()}
    assert "model.layers.0.self_attn.q_b_proj" in names and "model.layers.1.post_attention_layernorm.W_up" in names
    assert "model.layers.0.post_attention_layernorm.W_up" not in names  # (a dense layer's post norm is plain)


@pytest.mark.parametrize("over,field", [
    ({"n_group": 2}, "topk_group"),
    ({"topk_group": 1}, "topk_group"),
    ({"n_group": 3, "topk_group": 1}, "n_group"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"gated_norm_rank": 0}, "gated_norm_rank"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    axk2.check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        axk2.check_config(_cfg(**over))
