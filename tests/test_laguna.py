"""Laguna (laguna): transformers' defaults where a config leaves them out, the variants the tiny model does not take
(soft-capped router logits, a gate per channel, the default RoPE per type) against transformers' logits and greedy
tokens, the release's names, refusals by name. Its oracle, batch, prompt-cache and tier tests run with every
family's (tests/tiny_configs.py: per-layer head counts, sliding and full layers with their own RoPE, a gate per
head, a dense layer, GLM's scaled router beside a shared expert)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import hf_greedy_with_logits, hf_logits, load_hf, tiny_config_kwargs
from transformers import LagunaConfig

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.base import build
from colibri.models.laguna import ModelArgs, check_config, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "laguna", **tiny_config_kwargs("laguna"), **over}


def test_defaults_are_transformers() -> None:
    kw = {k: v for k, v in tiny_config_kwargs("laguna").items()
          if k not in ("layer_types", "num_attention_heads_per_layer", "rope_parameters")}
    ref = LagunaConfig(**kw)
    a = ModelArgs.from_dict({"model_type": "laguna", **kw})
    assert (a.layer_types, a.mlp_layer_types) == (ref.layer_types, ref.mlp_layer_types)
    assert a.num_attention_heads_per_layer == ref.num_attention_heads_per_layer
    for kind in ref.rope_parameters:
        assert a.rope(kind) == ref.rope_parameters[kind]
    model, _ = build("laguna", _cfg())  # the tiny config: heads, rotated share and window per layer
    assert [b.self_attn.a.heads for b in model.model.layers] == [4, 2, 4]
    assert [b.self_attn.a.positions.rotary_dim for b in model.model.layers] == [16, 8, 16]
    assert [b.self_attn.a.scores.sliding_window for b in model.model.layers] == [8, None, 8]


@pytest.mark.parametrize("over", [{"moe_router_logit_softcapping": 1.5}, {"gating": "per-element"},
                                  {"rope_parameters": None, "layer_types": None}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    hf = load_hf(ckpt.hf("laguna", **over))
    ref = hf_logits(hf, PROMPT * 3)  # 36 positions: past the sliding window of 8
    with colibri.load(ckpt.coli("laguna", "f32", **over), ctx_size=64, threads=2) as llm:
        got = llm.logits(PROMPT * 3).float()
        assert (got - ref).abs().max() < 1e-4
        want, _ = hf_greedy_with_logits(hf, PROMPT, 8)
        assert list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True)) == want
        gates = [b.mlp.gate for b in llm.model.model.layers if hasattr(b.mlp, "gate")]
        # soft-capped logits: the torch rule (the kernels have none); else GLM's sigmoid rule in the kernels
        assert all((g.native_routing() is None) == ("moe_router_logit_softcapping" in over) for g in gates)


def test_release_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.mlp.experts.e_score_correction_bias") \
        == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.mlp.shared_expert.up_proj.weight") \
        == "model.layers.3.mlp.shared_experts.up_proj.weight"
    assert sanitize("model.layers.3.self_attn.g_proj.weight") == "model.layers.3.self_attn.g_proj.weight"


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),  # one short
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"num_attention_heads_per_layer": [4, 3, 4]}, "num_attention_heads_per_layer"),  # not a multiple of 2 kv heads
    ({"gating": "per-token"}, "gating"),
    ({"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("per_head", [True, False])
def test_native_softplus_gate_is_the_torch_layers(per_head: bool) -> None:
    # The kernels' gate (kernels/block.c, and native.gate_mul on the layer-by-layer path) against GatedAttention's
    # torch arithmetic: softplus in f32 (past 20 the input itself), cast to bf16, the bf16 product.
    torch.manual_seed(0)
    T, H, D = 5, 4, 16
    o = torch.randn(T, H * D).bfloat16()
    g = (torch.randn(T, H if per_head else H * D) * 12).bfloat16()  # (some past the threshold of 20, some far below 0)
    gate = F.softplus(g.float()).bfloat16()
    want = (o.view(T, H, D) * gate.unsqueeze(-1)).view(T, -1) if per_head else o * gate
    assert torch.equal(native.gate_mul(o, g, H), want)
