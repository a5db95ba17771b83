"""ERNIE-4.5 MoE: which layers are sparse (transformers' own model decides), the released names, and what is
refused by name. Its oracle (logits and greedy tokens: the interleaved RoPE rows reordered at conversion),
batch, prompt-cache and tier tests run with every family's (tests/hf_tiny.py FAMILIES)."""

from __future__ import annotations

import pytest

from colibri.errors import ColibriError
from colibri.models.ernie4_5_moe import ModelArgs, check_config, sanitize
from tests.hf_tiny import build_tiny_model, tiny_config_kwargs


def _cfg(**over) -> dict:
    return {"model_type": "ernie4_5_moe", **tiny_config_kwargs("ernie4_5_moe"), **over}


@pytest.mark.parametrize("over", [{}, {"moe_layer_interval": 2, "num_hidden_layers": 5},
                                  {"moe_layer_start_index": 0, "moe_layer_end_index": 1, "num_hidden_layers": 4}])
def test_sparse_layers_are_transformers(over: dict) -> None:
    hf = build_tiny_model("ernie4_5_moe", **over)
    want = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    a = ModelArgs.from_dict(_cfg(**over))
    assert [a.is_sparse(i) for i in range(a.num_hidden_layers)] == want and any(want) and not all(want)


def test_released_names() -> None:
    assert sanitize("model.layers.3.mlp.moe_statics.e_score_correction_bias") == \
        "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.mlp.gate.moe_statics.e_score_correction_bias") == \
        "model.layers.3.mlp.gate.e_score_correction_bias"
    # the MTP layer's (tests/test_spec_mtp.py runs one)
    assert sanitize("model.mtp_block.0.self_attn.q_proj.weight") == "mtp.0.block.self_attn.q_proj.weight"
    assert sanitize("model.mtp_linear_proj.0.weight") == "mtp.0.eh_proj.weight"
    assert sanitize("model.mtp_emb_norm.0.weight") == "mtp.0.enorm.weight"
    assert sanitize("model.mtp_hidden_norm.0.weight") == "mtp.0.hnorm.weight"
    assert sanitize("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("over,field", [({"use_bias": True}, "use_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                                        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))
