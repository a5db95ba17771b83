"""Kolibri-1 (kolibri1): its router (chosen by logit + bias, weighted by the sigmoid of the logits) in torch and in the
kernels, the layer pattern as transformers decides it, the release's names mapped, refusals by name. Its oracle,
batch, prompt-cache, tier and one-call tests run with every family's (tests/tiny_configs.py: sliding layers with
RoPE over 8 positions, a full layer without RoPE, each sublayer's output norm, a shared expert)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import edited_copy, tiny_config_kwargs
from route_check import assert_native_routes_as_torch
from transformers import Kolibri1Config

from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.layers.moe import BiasedLogitRouter
from colibri.models.base import build
from colibri.models.kolibri1 import ModelArgs, check_config, sanitize


def _cfg(**over) -> dict:
    return {"model_type": "kolibri1", **tiny_config_kwargs("kolibri1"), **over}


def test_the_bias_chooses_by_logit_and_the_weights_are_sigmoids() -> None:
    """Logits 2, 1, 0, -1: the bias is added to the logits to choose (not to their sigmoids, as GLM's router does),
    and the weights are the sigmoids of the unbiased logits, in the order chosen."""
    r = BiasedLogitRouter(4, 4, 2, norm=False)
    r.weight.data = torch.eye(4)
    r.e_score_correction_bias.data = torch.tensor([0.0, 0.0, 0.0, 2.5])
    idx, w = r(torch.tensor([[2.0, 1.0, 0.0, -1.0]]))
    assert idx.tolist() == [[0, 3]]  # 2 + 0 and -1 + 2.5 = 1.5 beat 1 + 0
    torch.testing.assert_close(w, torch.tensor([[2.0, -1.0]]).sigmoid())
    r.e_score_correction_bias.data = torch.tensor([0.0, 0.0, 0.0, 1.9])
    idx, _ = r(torch.tensor([[2.0, 1.0, 0.0, -1.0]]))
    assert idx.tolist() == [[0, 1]]  # -1 + 1.9 = 0.9 < 1 (by sigmoid + bias, expert 3's 0.27 + 1.9 would win)
    r.norm = True
    _, w = r(torch.tensor([[2.0, 1.0, 0.0, -1.0]]))
    s = torch.tensor([[2.0, 1.0]]).sigmoid()
    torch.testing.assert_close(w, s / s.sum())


@pytest.mark.parametrize("norm", [True, False])
def test_bf16_rows_route_natively_as_torch_does(norm: bool) -> None:
    """bf16 rows take the kernels' ROUTE_LOGIT_BIAS_SIGMOID rule: the experts and weights of the torch rule on the
    same values."""
    g = torch.Generator().manual_seed(5)
    r = BiasedLogitRouter(32, 16, 4, norm)
    r.weight.data = torch.randn(16, 32, generator=g)
    r.e_score_correction_bias.data = torch.randn(16, generator=g) * 2
    assert_native_routes_as_torch(r, torch.randn(64, 32, generator=g))


@pytest.mark.parametrize("n", [3, 10, 12])
def test_layer_pattern_is_transformers(n: int) -> None:
    """A hub config without `layer_types` gets Kolibri1Config's: RoPE and a window on the sliding layers only."""
    kw = {k: v for k, v in tiny_config_kwargs("kolibri1").items() if k not in ("layer_types", "rope_parameters")}
    ref = Kolibri1Config(**{**kw, "num_hidden_layers": n})
    assert ModelArgs.from_dict({"model_type": "kolibri1", **kw, "num_hidden_layers": n}).layer_types == ref.layer_types
    model, _ = build("kolibri1", {**kw, "num_hidden_layers": n})
    for i, block in enumerate(model.model.layers):
        sliding = ref.layer_types[i] == "sliding_attention"
        a = block.self_attn.a
        assert (a.positions.use_rope, a.scores.sliding_window, a.output.out_norm) == (
            sliding, ref.sliding_window if sliding else None, True)
        assert a.positions.rope_theta == ref.rope_parameters["rope_theta"]


def test_release_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.post_attn_norm.weight") == "model.layers.3.self_attn.out_norm.weight"
    assert sanitize("model.layers.3.post_ffn_norm.weight") == "model.layers.3.mlp.out_norm.weight"
    assert sanitize("model.layers.3.moe.router.expert_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    # transformers' own names (a state_dict saved as it is in memory)
    assert sanitize("model.layers.3.post_self_attn_layernorm.weight") == "model.layers.3.self_attn.out_norm.weight"
    assert sanitize("model.layers.3.post_mlp_layernorm.weight") == "model.layers.3.mlp.out_norm.weight"
    kept = "model.layers.3.post_attention_layernorm.weight"  # (the MLP's input norm, as everywhere)
    assert sanitize(kept) == kept


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),  # one short
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_pattern_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("kolibri1"), tmp_path / "src", layer_types=["full_attention"])
    with pytest.raises(ColibriError, match="layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
