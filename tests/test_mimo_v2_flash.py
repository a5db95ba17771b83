"""MiMo-V2-Flash (mimo_v2_flash): the layer and RoPE rules as transformers', the released config's names, int8
batches, refusals. Its oracle, batch, prompt-cache and tier tests run with every family's (tests/hf_tiny.py
FAMILIES: a full-attention layer and two sliding ones with sinks, narrower scaled values, per-type RoPE)."""

from __future__ import annotations

import pytest
from hf_tiny import tiny_config_kwargs
from transformers import MiMoV2FlashConfig

import colibri
from colibri.errors import ColibriError
from colibri.models.mimo_v2_flash import ModelArgs, check_config, sanitize

P = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "mimo_v2_flash", **tiny_config_kwargs("mimo_v2_flash"), **over}


def test_defaults_and_released_names_follow_transformers() -> None:
    base = {k: v for k, v in tiny_config_kwargs("mimo_v2_flash").items() if k != "rope_parameters"}
    kw = {**base, "num_hidden_layers": 13, "sliding_window_size": 127, "routed_scaling_factor": None}
    ref = MiMoV2FlashConfig(**kw)
    a = ModelArgs.from_dict({"model_type": "mimo_v2_flash", **kw})
    assert a.kinds() == ref.layer_types
    assert [a.is_moe(i) for i in range(13)] == [t == "sparse" for t in ref.mlp_layer_types]
    assert a.sliding_window == ref.sliding_window == 128 and a.routed_scaling_factor == ref.routed_scaling_factor
    assert {k: a.rope(k) for k in ("full_attention", "sliding_attention")} == ref.rope_parameters
    assert sanitize("model.layers.1.self_attn.attention_sink_bias") == "model.layers.1.self_attn.sinks"
    # the release's MTP layers (layers/mtp.py's names; tests/test_spec_mtp.py runs one)
    assert {n: sanitize(f"model.mtp.layers.2.{n}") for n in (
        "enorm.weight", "eh_proj.weight", "final_layernorm.weight", "pre_mlp_layernorm.weight",
        "self_attn.attention_sink_bias", "mlp.up_proj.weight")} == {
        "enorm.weight": "mtp.2.enorm.weight", "eh_proj.weight": "mtp.2.eh_proj.weight",
        "final_layernorm.weight": "mtp.2.norm.weight",
        "pre_mlp_layernorm.weight": "mtp.2.block.post_attention_layernorm.weight",
        "self_attn.attention_sink_bias": "mtp.2.block.self_attn.sinks",
        "mlp.up_proj.weight": "mtp.2.block.mlp.up_proj.weight"}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_batches_give_each_sequence_its_own_tokens(ckpt, scheme) -> None:
    prompts = [P, P[:5] + [88, 9], [1, 250, 4, 4, 19]]
    with colibri.load(ckpt.coli("mimo_v2_flash", scheme, head_dim=32, v_head_dim=32 if scheme == "int4" else 16),
                      ctx_size=96, threads=2, slots=3) as llm:
        together = [h.wait() for h in [llm.submit(p, 12, ignore_eos=True) for p in prompts]]
        alone = [list(llm.generate_ids(p, 12, temperature=0, ignore_eos=True)) for p in prompts]
    assert together == alone and len({tuple(t) for t in alone}) == 3


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["full_attention", "chunked_attention", "sliding_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "sliding_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                          "sliding_attention": {"rope_theta": 1e4}}}, "rope_type"),
    ({"n_group": 3}, "n_group"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))
