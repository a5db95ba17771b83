"""Granite MoE with a shared expert (`granitemoeshared`) and Granite's sliding-window MoE (`granitemoe_swa`). The
oracle, batch, tier, prompt-cache and native-accuracy tests run both with every family (tests/tiny_configs.py
FAMILIES; test_native_step.py the SWA one's one-call step); here the shared MLP's layout, the per-layer attention
settings, the native blocks and the refusals."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_logits, load_hf
from safetensors.torch import load_file

import colibri
from colibri.engine.decode_plan import DecodePlan
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models.base import build
from colibri.models.granitemoe_swa import check_config

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def test_the_shared_mlp_is_input_linears_halves_and_a_scaled_output(ckpt) -> None:
    st = load_file(ckpt.hf("granitemoeshared") / "model.safetensors")
    hf = "model.layers.1.shared_mlp."
    fused, out = st[hf + "input_linear.weight"], st[hf + "output_linear.weight"]
    with Container(ckpt.coli("granitemoeshared", "f32")) as c:
        pre = "model.layers.1.mlp.shared_mlp."
        assert torch.equal(c.tensor(pre + "gate_proj.weight"), fused[:64])
        assert torch.equal(c.tensor(pre + "up_proj.weight"), fused[64:])
        # (the residual multiplier, 0.8 in the tiny config, folded as the routed experts' is in the router)
        torch.testing.assert_close(c.tensor(pre + "down_proj.weight"), out * 0.8, rtol=1e-6, atol=0)


def test_no_shared_width_is_granites_layers(ckpt) -> None:
    ref = hf_logits(load_hf(ckpt.hf("granitemoeshared", shared_intermediate_size=0)), PROMPT)
    with colibri.load(ckpt.coli("granitemoeshared", "f32", shared_intermediate_size=0), ctx_size=64, threads=2) as llm:
        assert all(getattr(b.mlp, "shared_mlp", None) is None for b in llm.model.model.layers)
        got = llm.logits(PROMPT).float()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_each_layer_takes_its_own_attention_settings() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "intermediate_size": 32,
            "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 384, "rope_theta": 1e4}
    model, _ = build("granitemoe_swa", base)  # (defaults: every 4th layer full from 0, the rest slide over 128)
    args = [b.self_attn.a for b in model.model.layers]
    assert [a.scores.sliding_window for a in args] == [None, 128, 128, 128, None, 128, 128, 128]
    assert all(a.scores.sinks and a.positions.use_rope and a.positions.rope_theta == 1e4 for a in args)
    model, _ = build("granitemoe_swa", {**base, "layer_rope_theta": [0, 5e4, 1e4, 0, 1e4, 1e4, 1e4, 2e5]})
    args = [b.self_attn.a for b in model.model.layers]
    assert [a.positions.use_rope for a in args] == [False, True, True, False, True, True, True, True]
    assert [a.positions.rope_theta for a in args][1::6] == [5e4, 2e5]


def test_the_native_blocks_take_the_swa_layers(ckpt) -> None:
    """int8 runs every layer in the kernels: sinks, sliding and full windows, the layer without RoPE, the shared
    expert in the MoE block (test_native_step.py: the same bits as the kernels one by one)."""
    from colibri.engine import native_step

    with colibri.load(ckpt.coli("granitemoe_swa", "int8"), ctx_size=64, threads=2) as llm:
        m = llm.model
        for b in m.model.layers:
            assert b.self_attn._native_layer(b.input_layernorm, b.post_attention_layernorm) is not None
            assert b.mlp.shared_table() not in (None, False)
        assert native_step.tail(m) is not None and DecodePlan(m).native_layers() is not None


@pytest.mark.parametrize("change, want", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "3 entries of full_attention / sliding_attention"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "3 entries"),
    ({"layer_rope_theta": [1e4, -1, 1e4]}, "3 numbers >= 0"),
    ({"layer_rope_theta": [1e4, 1e4]}, "3 numbers >= 0"),
    ({"hidden_act": "gelu"}, "only silu"),
])
def test_refusals(change: dict, want: str) -> None:
    with pytest.raises(ColibriError, match=f"granitemoe.*{want}"):
        check_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, **change})
