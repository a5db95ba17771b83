"""AllenAI's FlexOlmo (`flex_olmo`). The oracle, batch, tier, prompt-cache and native-accuracy tests run it with every
family (tests/tiny_configs.py FAMILIES; test_native_step.py its one-call step); here its names, the blocks without a
norm before their sublayers in the kernels, and its refusals."""

from __future__ import annotations

import pytest

import colibri
from colibri.engine.decode_plan import DecodePlan
from colibri.errors import ColibriError
from colibri.layers.layers import NoNorm
from colibri.models.flex_olmo import check_config, sanitize


def test_names() -> None:
    layer = "model.layers.3."
    for hf, ours in (("post_attention_layernorm.weight", "self_attn.out_norm.weight"),
                     ("post_feedforward_layernorm.weight", "mlp.out_norm.weight"),
                     ("self_attn.q_norm.weight", "self_attn.q_norm.weight"), ("mlp.gate.weight", "mlp.gate.weight")):
        assert sanitize(layer + hf) == layer + ours


def test_the_native_blocks_take_blocks_without_input_norms(ckpt) -> None:
    """int8: the attention block gets NULL input / pre-MLP norm weights (the rows as they are) and the output norms;
    the MoE block its output norm; the one-call step all of it (test_native_step.py: the same bits as the kernels
    one by one)."""
    with colibri.load(ckpt.coli("flex_olmo", "int8"), ctx_size=64, threads=2) as llm:
        m = llm.model
        for b in m.model.layers:
            assert type(b.input_layernorm) is NoNorm and type(b.post_attention_layernorm) is NoNorm
            layer = b.self_attn._native_layer(b.input_layernorm, b.post_attention_layernorm)
            assert layer is not None and not layer.in_w and not layer.post_w
            assert layer.output.contents.norm_w == b.self_attn.out_norm.weight.data_ptr()
        plan = DecodePlan(m).native_layers()
        assert plan is not None and all(plan.moe[i].out_w for i in range(len(m.model.layers)))
        assert not any(b.mlp.gate.norm_topk_prob for b in m.model.layers)


@pytest.mark.parametrize("change, want", [({"hidden_act": "gelu"}, "only silu"),
                                          ({"rope_parameters": {"rope_type": "nope!"}}, "rope_type")])
def test_refusals(change: dict, want: str) -> None:
    with pytest.raises(ColibriError, match=f"flex_olmo.*{want}"):
        check_config({"hidden_size": 64, "num_attention_heads": 4, **change})
