"""Flint (flint): the layer patterns as transformers decides them (which layers slide and rotate, which are dense),
the release's sink name mapped, refusals by name. Its oracle, batch, prompt-cache, tier and one-call tests run with
every family's (tests/tiny_configs.py: sinks, sliding layers with RoPE over 8 positions, a full layer without
RoPE that is dense, the sigmoid router beside a shared expert)."""

from __future__ import annotations

import pytest
from hf_tiny import edited_copy, tiny_config_kwargs
from transformers import FlintConfig

from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.base import build
from colibri.models.flint import ModelArgs, check_config, sanitize


def _cfg(**over) -> dict:
    return {"model_type": "flint", **tiny_config_kwargs("flint"), **over}


@pytest.mark.parametrize("n", [3, 9, 14])
def test_layer_patterns_are_transformers(n: int) -> None:
    """A hub config without the derived lists gets FlintConfig's: which layers slide, which are dense."""
    kw = {k: v for k, v in tiny_config_kwargs("flint").items()
          if k not in ("layer_types", "mlp_only_layers", "rope_parameters")}
    ref = FlintConfig(**{**kw, "num_hidden_layers": n})
    a = ModelArgs.from_dict({"model_type": "flint", **kw, "num_hidden_layers": n})
    assert a.layer_types == ref.layer_types
    assert [a.is_sparse(i) for i in range(n)] == [i not in ref.mlp_only_layers for i in range(n)]
    model, _ = build("flint", {**kw, "num_hidden_layers": n})
    for i, block in enumerate(model.model.layers):  # RoPE and a window on the sliding layers only; sinks everywhere
        sliding = ref.layer_types[i] == "sliding_attention"
        attn = block.self_attn.a
        assert (attn.positions.use_rope, attn.scores.sliding_window, attn.scores.sinks) == (
            sliding, ref.sliding_window if sliding else None, True)
        assert attn.positions.rope_theta == ref.rope_parameters["rope_theta"]


def test_release_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.self_attn.softmax_offset") == "model.layers.3.self_attn.sinks"
    kept = "model.layers.3.mlp.shared_expert.up_proj.weight"
    assert sanitize(kept) == kept


def test_the_router_bias_is_no_checkpoint_tensor() -> None:
    """Flint's router has no correction bias: the zero one the kernels' sigmoid rule takes is not looked for."""
    from colibri.models.base import expected_tensors

    model, _ = build("flint", _cfg())
    names = expected_tensors(model)
    assert "model.layers.0.mlp.gate.weight" in names
    assert not any("e_score_correction_bias" in n for n in names)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),  # one short
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_pattern_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("flint"), tmp_path / "src", layer_types=["full_attention"])
    with pytest.raises(ColibriError, match="layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
