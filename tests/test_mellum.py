"""Mellum 2 (mellum): the layer lists and the per-type RoPE as transformers decides them, the multi-token-prediction
module dropped and listed, refusals by name. Its oracle, batch, prompt-cache, tier and one-call tests run with every
family's (tests/tiny_configs.py: a sliding layer over 8 positions with its own RoPE base, a dense layer)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, tiny_config_kwargs
from transformers import MellumConfig

from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.base import build
from colibri.models.mellum import ModelArgs, check_config, sanitize

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "mellum", **tiny_config_kwargs("mellum"), **over}


def test_defaults_are_transformers() -> None:
    """A hub config without the lists or `rope_parameters`: every layer full and sparse, each type's base
    MellumConfig's."""
    kw = {k: v for k, v in tiny_config_kwargs("mellum").items()
          if k not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    ref = MellumConfig(**kw)
    a = ModelArgs.from_dict({"model_type": "mellum", **kw})
    assert (a.layer_types, a.mlp_layer_types) == (ref.layer_types, ref.mlp_layer_types)
    for kind in ("full_attention", "sliding_attention"):
        assert a.rope(kind)["rope_theta"] == ref.rope_parameters[kind]["rope_theta"]
    model, _ = build("mellum", _cfg())  # the tiny config: its own bases per type, the window on sliding layers
    for i, block in enumerate(model.model.layers):
        kind = _cfg()["layer_types"][i]
        attn = block.self_attn.a
        assert attn.positions.rope_theta == _cfg()["rope_parameters"][kind]["rope_theta"]
        assert attn.scores.sliding_window == (8 if kind == "sliding_attention" else None)


def test_mtp_module_is_dropped_and_recorded(ckpt, tmp_path) -> None:
    """A config that counts no MTP layer (no `num_mtp_layers`): the module is dropped and listed (a counted one is
    kept: tests/test_spec_mtp.py)."""
    def mtp(base: dict) -> dict:  # its projection and norms, plus a whole decoder layer under mtp.layers.0
        return {"mtp.eh_proj.weight": torch.randn(64, 128), "mtp.enorm.weight": torch.ones(64)} | {
            k.replace("model.layers.2.", "mtp.layers.0."): v.clone() for k, v in base.items()
            if k.startswith("model.layers.2.")}

    assert sanitize("mtp.layers.0.mlp.gate.weight") == "mtp.0.block.mlp.gate.weight"  # (Qwen3-Next's names)
    assert sanitize("mtp.fc.weight") == "mtp.0.eh_proj.weight" and sanitize("model.layers.0.mlp.gate.weight")
    src = edited_copy(ckpt.hf("mellum"), tmp_path / "src")
    converts_dropping(src, mtp, ckpt.coli("mellum", "f32"), tmp_path / "m.coli", IDS)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),  # one short
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.5}}}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_pattern_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("mellum"), tmp_path / "src", layer_types=["full_attention"])
    with pytest.raises(ColibriError, match="layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
