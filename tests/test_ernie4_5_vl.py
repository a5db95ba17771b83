"""ERNIE-4.5-VL's text model: variants against transformers' multimodal model fed text (its text experts and
M-RoPE at text positions), the released layout (what save_pretrained writes: per-expert text and vision experts,
a transposed router, a two-row correction bias) read through `source_view`, the [text, vision] config pairs, and
what is refused by name. Its oracle in both layouts, batch, prompt-cache, tier and one-call tests run with every
family's (tests/tiny_configs.py FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from oracle_check import matches_transformers

from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models.ernie4_5_vl_moe_text import ModelArgs, check_config, flat_config, sanitize
from tests.hf_tiny import build_tiny_model, tiny_config_kwargs

FAMILY = "ernie4_5_vl_moe_text"
PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return flat_config({"model_type": FAMILY, **tiny_config_kwargs(FAMILY), **over})


@pytest.mark.parametrize("over", [
    # every layer sparse, two shared experts, wider vision experts than text ones (never run), another base
    {"mlp_layer_types": ["sparse"] * 3, "moe_num_shared_experts": 2, "moe_intermediate_size": [32, 48],
     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}},
    # a dense layer between sparse ones, no shared expert, other M-RoPE sections (the same text positions)
    {"mlp_layer_types": ["sparse", "dense", "sparse"], "moe_num_shared_experts": 0, "num_hidden_layers": 3,
     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 2, 4]}},
])
def test_variants_match_transformers(ckpt, over: dict) -> None:
    matches_transformers(ckpt, FAMILY, over, PROMPT)


def test_sparse_layers_are_transformers() -> None:
    for types in (None, ["sparse", "dense", "sparse"]):
        over = {} if types is None else {"mlp_layer_types": types}
        hf = build_tiny_model(FAMILY, **over).model.language_model
        want = [hasattr(layer.mlp, "text_moe") for layer in hf.layers]
        a = ModelArgs.from_dict(_cfg(**over))
        assert [a.is_sparse(i) for i in range(a.num_hidden_layers)] == want and any(want) and not all(want)
    # transformers' default when the config has none: the first layer dense
    cfg = _cfg()
    del cfg["mlp_layer_types"]
    assert ModelArgs.from_dict(cfg).mlp_layer_types == ["dense", "sparse", "sparse"]


def test_released_layout_converts_to_the_text_model(ckpt) -> None:
    """The folder save_pretrained writes is the release's layout: 2E per-expert experts (text first), the text
    router [hidden, E] beside the vision one, the correction bias [2, E]. Converted: E experts of the text width,
    the router [E, hidden], the bias's text row; the vision side listed as dropped."""
    from safetensors import safe_open

    src = ckpt.hf(FAMILY)

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        router = f.get_tensor("model.layers.1.mlp.gate.weight")
        bias = f.get_tensor("model.layers.1.mlp.moe_statics.e_score_correction_bias")
        gate15 = f.get_tensor("model.layers.1.mlp.experts.15.gate_proj.weight")
    assert router.shape == (64, 8) and bias.shape == (2, 8) and gate15.shape == (16, 64)  # (vision: width 16)
    assert "model.layers.1.mlp.gate.weight_1" in names and any(n.startswith("model.vision_model.") for n in names)
    with Container(ckpt.coli(FAMILY, "f32")) as c:
        meta = c.meta
        dropped = meta["converter"]["dropped"]
        assert "model.layers.1.mlp.gate.weight_1" in dropped
        assert "model.layers.1.mlp.experts.8.up_proj.weight" in dropped  # (hidden by the view, listed all the same)
        assert "model.layers.1.mlp.experts.7.up_proj.weight" not in dropped
        assert torch.equal(c.tensor("model.layers.1.mlp.gate.weight"), router.T)
        assert torch.equal(c.tensor("model.layers.1.mlp.gate.e_score_correction_bias"), bias[:1])
        assert meta["config"]["moe_intermediate_size"] == 32 and meta["config"]["moe_num_experts"] == 8
        assert c.record_names() and all(".mlp.experts." in r for r in c.record_names())
        assert not any(int(r.rsplit(".", 1)[1]) >= 8 for r in c.record_names())


def test_released_names() -> None:
    assert sanitize("model.language_model.layers.2.mlp.text_moe.experts.gate_up_proj") == \
        "model.layers.2.mlp.experts.gate_up_proj"
    assert sanitize("model.language_model.layers.2.mlp.text_moe.gate.moe_statics.e_score_correction_bias") == \
        "model.layers.2.mlp.gate.e_score_correction_bias"
    assert sanitize("model.language_model.layers.2.mlp.text_moe.gate.weight") == "model.layers.2.mlp.gate.weight"
    assert sanitize("model.layers.2.mlp.moe_statics.e_score_correction_bias") == \
        "model.layers.2.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.2.mlp.shared_experts.down_proj.weight") == \
        "model.layers.2.mlp.shared_experts.down_proj.weight"
    assert sanitize("model.language_model.norm.weight") == "model.norm.weight"
    assert sanitize("lm_head.weight") == "lm_head.weight"
    for gone in ("model.language_model.layers.2.mlp.vision_moe.experts.down_proj", "model.layers.2.mlp.gate.weight_1",
                 "model.vision_tower.blocks.0.attn.qkv.weight", "model.vision_model.blocks.0.attn.qkv.weight",
                 "model.resampler_model.spatial_linear.0.weight", "model.visual.merger.weight"):
        assert sanitize(gone) is None, gone


def test_text_vision_config_pairs() -> None:
    cfg = flat_config({**tiny_config_kwargs(FAMILY), "moe_num_experts": [8, 8], "moe_intermediate_size": [32, 16]})
    assert cfg["moe_num_experts"] == 8 and cfg["moe_intermediate_size"] == 32
    with pytest.raises(ColibriError, match="moe_num_experts"):
        flat_config({**tiny_config_kwargs(FAMILY), "moe_num_experts": [8, 4]})


@pytest.mark.parametrize("over,field", [
    ({"use_bias": True}, "use_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "mrope_section": [3, 3, 2]}},
     "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}}, "mrope_section"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 3]}}, "mrope_section"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))
