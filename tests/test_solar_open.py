"""Solar Open (`solar_open`): GLM-4.5's MoE layers everywhere under Llama's attention. The oracle, batch, tier,
prompt-cache and native-accuracy tests run it with every family (tests/tiny_configs.py FAMILIES; test_native_step.py
its one-call step); here its layout and its refusals."""

from __future__ import annotations

import json

import pytest

import colibri
from colibri.errors import ColibriError
from colibri.layers.moe import SparseMoE
from colibri.models.solar_open import ModelArgs, check_config


def test_every_layer_is_moe_and_the_whole_head_rotates(ckpt) -> None:
    cfg = json.loads((ckpt.hf("solar_open") / "config.json").read_text())
    with colibri.load(ckpt.coli("solar_open", "f32"), ctx_size=64, threads=2) as llm:
        layers = llm.model.model.layers
        assert all(isinstance(b.mlp, SparseMoE) for b in layers)
        assert all(b.self_attn.rope.dim == cfg["head_dim"] and b.self_attn.o_proj.bias is None for b in layers)
        assert all(b.self_attn.q_proj.bias is not None for b in layers)
    # The released config has no dense width (transformers' own config class has no such field)
    released = {k: v for k, v in cfg.items() if k != "intermediate_size"}
    assert ModelArgs.from_dict(released).intermediate_size == cfg["moe_intermediate_size"]


def test_refusals() -> None:
    for change, want in (({"first_k_dense_replace": 1}, "every layer MoE"), ({"use_qk_norm": True}, "no q/k norm"),
                         ({"scoring_func": "softmax"}, "only sigmoid"), ({"hidden_act": "gelu"}, "only silu"),
                         ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "whole head")):
        with pytest.raises(ColibriError, match=f"solar_open.*{want}"):
            check_config({"n_routed_experts": 8, **change})
