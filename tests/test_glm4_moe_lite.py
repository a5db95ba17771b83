"""GLM-4.7-Flash (glm4_moe_lite): the layer pattern as transformers decides it (with and without
`mlp_layer_types`), the multi-token-prediction layer dropped, and what the family does not implement refused
by name. Its oracle, batch, prompt-cache, tier and one-call tests run with every family's (tests/hf_tiny.py
FAMILIES; that config has a sparse layer 0 and a dense layer 1)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, hf_logits, load_hf, tiny_config_kwargs

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.glm4_moe_lite import ModelArgs, check_config

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "glm4_moe_lite", **tiny_config_kwargs("glm4_moe_lite"), **over}


def test_without_mlp_layer_types_layer_0_is_dense_as_in_transformers(ckpt, tmp_path) -> None:
    hf = load_hf(ckpt.hf("glm4_moe_lite", mlp_layer_types=None))
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == \
        ["Glm4MoeLiteMLP", "Glm4MoeLiteMoE", "Glm4MoeLiteMoE"]
    # as released: first_k_dense_replace, no mlp_layer_types
    src = edited_copy(ckpt.hf("glm4_moe_lite", mlp_layer_types=None), tmp_path / "src", ("mlp_layer_types",),
                      first_k_dense_replace=1)
    cfg = json.loads((src / "config.json").read_text())
    assert [ModelArgs.from_dict(cfg).is_moe(i) for i in range(3)] == [False, True, True]
    out = convert(src, tmp_path / "m.coli", "f32", progress=False)
    ours = colibri.load(out, ctx_size=64, threads=2).logits(IDS)
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_mtp_layer_is_dropped_and_recorded_with_no_mtp(ckpt, tmp_path) -> None:
    """--no-mtp (kept by default: tests/test_spec_mtp.py)."""
    src = edited_copy(ckpt.hf("glm4_moe_lite"), tmp_path / "src", num_nextn_predict_layers=1)
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]

    def mtp(base: dict) -> dict:  # the MTP module: its projection and norm plus a whole decoder layer, at index n
        return {f"model.layers.{n}.eh_proj.weight": torch.randn(4, 4), f"model.layers.{n}.enorm.weight":
                torch.ones(4)} | {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in base.items()
                                  if k.startswith(f"model.layers.{n - 1}.")}

    converts_dropping(src, mtp, ckpt.coli("glm4_moe_lite", "f32"), tmp_path / "m.coli", IDS, keep_mtp=False)


@pytest.mark.parametrize("over,field", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),  # one short
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": None, "first_k_dense_replace": 2}, "first_k_dense_replace"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_pattern_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("glm4_moe_lite"), tmp_path / "src", mlp_layer_types=["sparse", "sparse"])
    with pytest.raises(ColibriError, match="mlp_layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
