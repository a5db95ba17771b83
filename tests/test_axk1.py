"""A.X K1 (axk1): which layers are MoE as transformers decides it, the release's decoder-level norm mapped onto the MoE
block, the dense layers' copies dropped and listed, refusals by name. Its oracle, batch, prompt-cache, tier and
one-call tests run with every family's (tests/tiny_configs.py: MLA with a q LoRA, two router groups, a dense
layer 0, the MoE output norm)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, tiny_config_kwargs
from transformers import AXK1Config

from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.axk1 import ModelArgs, check_config, sanitize

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "axk1", **tiny_config_kwargs("axk1"), **over}


@pytest.mark.parametrize("legacy", [{}, {"first_k_dense_replace": 2, "moe_layer_freq": 2},
                                    {"first_k_dense_replace": 0, "moe_layer_freq": 3}])
def test_moe_layers_are_transformers(legacy: dict) -> None:
    """A release config gives the legacy fields, transformers' saved one the derived `mlp_layer_types`."""
    kw = {k: v for k, v in tiny_config_kwargs("axk1").items() if k != "first_k_dense_replace"}
    ref = AXK1Config(**{**kw, "num_hidden_layers": 7, **legacy})
    a = ModelArgs.from_dict({"model_type": "axk1", **kw, "num_hidden_layers": 7, **legacy})
    assert [a.is_moe(i) for i in range(7)] == [t == "sparse" for t in ref.mlp_layer_types]
    given = {"num_hidden_layers": 7, "mlp_layer_types": ref.mlp_layer_types}
    b = ModelArgs.from_dict({"model_type": "axk1", **kw, **given})
    assert [b.is_moe(i) for i in range(7)] == [t == "sparse" for t in ref.mlp_layer_types]
    assert (a.n_group, a.topk_group, a.routed_scaling_factor) == (2, 1, 2.5)  # (the tiny config's)
    d = ModelArgs.from_dict({k: v for k, v in _cfg().items() if k not in ("n_group", "topk_group")})
    plain = AXK1Config()
    assert (d.n_group, d.topk_group, d.first_k_dense_replace) == (plain.n_group, plain.topk_group, 1)


def test_release_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.post_mlp_layernorm.weight") == "model.layers.3.mlp.out_norm.weight"
    assert sanitize("model.layers.3.mlp.post_mlp_layernorm.weight") == "model.layers.3.mlp.out_norm.weight"
    kept = "model.layers.3.post_attention_layernorm.weight"
    assert sanitize(kept) == kept


def test_dense_layers_norms_are_dropped_and_listed(ckpt, tmp_path) -> None:
    """The release keeps a post_mlp_layernorm in its dense layers too, which transformers ignores: the converter
    drops it there (and lists it), and the logits are those without it."""
    def dense_norm(base: dict) -> dict:
        assert "model.layers.0.post_mlp_layernorm.weight" not in base  # (layer 0 is dense)
        return {"model.layers.0.post_mlp_layernorm.weight": torch.full((64,), 3.0)}

    src = edited_copy(ckpt.hf("axk1"), tmp_path / "src")
    converts_dropping(src, dense_norm, ckpt.coli("axk1", "f32"), tmp_path / "m.coli", IDS)


@pytest.mark.parametrize("over,field", [
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),  # one short
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_list_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("axk1"), tmp_path / "src", mlp_layer_types=["dense"])
    with pytest.raises(ColibriError, match="mlp_layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
