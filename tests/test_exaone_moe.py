"""K-EXAONE (exaone_moe): the layer patterns as transformers decides them (which layers slide, which have no
RoPE, which are dense), the hub names mapped, the MTP module dropped, refusals by name. Its oracle, batch,
prompt-cache, tier and one-call tests run with every family's (tests/hf_tiny.py FAMILIES: sliding layers with
RoPE, full layers without, a dense layer 0)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, tiny_config_kwargs
from transformers import ExaoneMoeConfig

from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.exaone_moe import ModelArgs, check_config, sanitize

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "exaone_moe", **tiny_config_kwargs("exaone_moe"), **over}


@pytest.mark.parametrize("over", [{"sliding_window": 8, "sliding_window_pattern": 4, "num_hidden_layers": 9},
                                  {"sliding_window": 8, "sliding_window_pattern": 1},
                                  {"sliding_window": 8, "sliding_window_pattern": 3, "num_hidden_layers": 7},
                                  {"first_k_dense_replace": 3, "num_hidden_layers": 5}])
def test_layer_patterns_are_transformers(over) -> None:
    ref = ExaoneMoeConfig(**{**tiny_config_kwargs("exaone_moe"), **over})
    n = ref.num_hidden_layers
    # what a hub config.json without the derived lists gives
    a = ModelArgs.from_dict({k: v for k, v in _cfg(**over).items() if k not in ("layer_types", "mlp_layer_types")})
    assert [a.window(i) is not None for i in range(n)] == [t == "sliding_attention" for t in ref.layer_types]
    assert [a.is_moe(i) for i in range(n)] == [t == "sparse" for t in ref.mlp_layer_types]
    # RoPE on the sliding layers only (Exaone4Attention's rule while a window is set, as this config's must be)
    assert [a.rope_on(i) for i in range(n)] == [t == "sliding_attention" for t in ref.layer_types]


def test_hub_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.mlp.e_score_correction_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    # the MTP module: Qwen3-Next's layout (tests/test_spec_mtp.py runs one)
    assert sanitize("mtp.layers.0.mlp.up_proj.weight") == "mtp.0.block.mlp.up_proj.weight"
    assert sanitize("mtp.fc.weight") == "mtp.0.eh_proj.weight" and sanitize("mtp.norm.weight") == "mtp.0.norm.weight"


def test_mtp_module_is_dropped_and_recorded(ckpt, tmp_path) -> None:
    """A config that counts no MTP layer (no `num_nextn_predict_layers`): the module is dropped and listed."""
    def mtp(base: dict) -> dict:  # its projection and norm, plus a whole decoder layer under mtp.layers.0
        return {"mtp.fc.weight": torch.randn(4, 8), "mtp.norm.weight": torch.ones(4)} | {
            k.replace("model.layers.3.", "mtp.layers.0."): v.clone() for k, v in base.items()
            if k.startswith("model.layers.3.")}

    src = edited_copy(ckpt.hf("exaone_moe"), tmp_path / "src")
    converts_dropping(src, mtp, ckpt.coli("exaone_moe", "f32"), tmp_path / "m.coli", IDS)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),  # one short
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
    ({"sliding_window_pattern": "LLLG"}, "sliding_window_pattern"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"n_group": 3}, "n_group"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_pattern_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("exaone_moe"), tmp_path / "src", layer_types=["full_attention"])
    with pytest.raises(ColibriError, match="layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
