"""Hunyuan-A13B (hunyuan_v1_moe): its RoPE's NTK alpha as transformers computes it, the hub names mapped, and
what transformers' port does not implement refused by name. Its oracle, batch, prompt-cache, tier and
one-call tests run with every family's (tests/hf_tiny.py FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from transformers import HunYuanMoEV1Config
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1RotaryEmbedding

from colibri.errors import ColibriError
from colibri.layers.layers import rope_inv_freq, rope_scaling
from colibri.models.hunyuan_v1_moe import ModelArgs, check_config, sanitize
from tests.hf_tiny import tiny_config_kwargs


def _cfg(**over) -> dict:
    return {"model_type": "hunyuan_v1_moe", **tiny_config_kwargs("hunyuan_v1_moe"), **over}


@pytest.mark.parametrize("alpha,theta,dim", [(1000.0, 10000.0, 16), (1000.0, 10000.0, 128), (50.0, 5e5, 64)])
def test_ntk_alpha_rope_is_transformers(alpha, theta, dim) -> None:
    params = {"rope_type": "dynamic", "alpha": alpha, "factor": 1.0, "rope_theta": theta}
    cfg = HunYuanMoEV1Config(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, rope_parameters=params)
    ref = HunYuanMoEV1RotaryEmbedding(cfg).inv_freq
    scaling = rope_scaling({"rope_parameters": params})
    assert scaling["rope_type"] == "ntk_alpha"
    inv, mscale = rope_inv_freq(dim, theta, scaling, 4096)
    assert torch.equal(inv, ref) and mscale == 1.0


def test_hub_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.mlp.gate.wg.weight") == "model.layers.3.mlp.gate.weight"
    assert sanitize("model.layers.0.self_attn.query_layernorm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert sanitize("model.layers.0.self_attn.key_layernorm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert sanitize("model.layers.0.mlp.shared_mlp.up_proj.weight") == "model.layers.0.mlp.shared_mlp.up_proj.weight"


def test_per_layer_lists_of_one_value_are_taken() -> None:
    n = tiny_config_kwargs("hunyuan_v1_moe")["num_hidden_layers"]
    cfg = _cfg(moe_topk=[2] * n, num_shared_expert=[1] * n, moe_intermediate_size=[32] * n, use_cla=False,
               use_mixed_mlp_moe=True, attention_head_dim=16)
    check_config(cfg)
    a = ModelArgs.from_dict(cfg)
    assert a.moe_topk == 2 and a.head_dim == 16


@pytest.mark.parametrize("over,field", [({"moe_topk": [2, 1, 2]}, "moe_topk"),
                                        ({"num_shared_expert": 2}, "num_shared_expert"),
                                        ({"moe_intermediate_size": [64, 64, 64]}, "moe_intermediate_size"),
                                        ({"use_cla": True}, "use_cla"),
                                        ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe"),
                                        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                              "rope_theta": 1e4}}, "rope_type"),
                                        ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_per_layer_lists_are_checked_and_refused_where_a_family_takes_one_value() -> None:
    from colibri.format.validate import check_config as validate

    n = tiny_config_kwargs("hunyuan_v1_moe")["num_hidden_layers"]
    validate("hunyuan_v1_moe", _cfg(moe_intermediate_size=[32] * n, moe_topk=[2] * n, num_shared_expert=[1] * n))
    with pytest.raises(ColibriError, match="moe_topk"):
        validate("hunyuan_v1_moe", _cfg(moe_topk=[2, 0, 2]))  # each value in range
    qwen = {"model_type": "qwen3_moe", **tiny_config_kwargs("qwen3_moe")}
    with pytest.raises(ColibriError, match="moe_intermediate_size.*wrong type"):
        validate("qwen3_moe", {**qwen, "moe_intermediate_size": [32] * 3})


def test_tied_embeddings_convert_to_transformers_logits(ckpt) -> None:
    """Hunyuan-A13B's released config ties the head to the embedding (no lm_head tensor in the folder)."""
    from hf_tiny import hf_logits, load_hf

    import colibri

    ids = [1, 17, 42, 99, 7, 150, 23, 64]
    src = ckpt.hf("hunyuan_v1_moe", tie_word_embeddings=True)
    with colibri.load(ckpt.coli("hunyuan_v1_moe", "f32", tie_word_embeddings=True)) as llm:
        torch.testing.assert_close(llm.logits(ids), hf_logits(load_hf(src), ids), rtol=1e-4, atol=1e-4)
