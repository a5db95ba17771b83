"""LFM2-MoE (lfm2_moe): the variants the tiny model does not take (the release's tied head under its own key, biased
convolutions and projections, no selection bias, no renormalising) against transformers' logits and greedy tokens;
names and refusals (chunked prompts, batches and prompt caching off: tests/test_state_models.py). Its oracle, batch
and tier tests run with every family's (tests/tiny_configs.py: conv, attention and conv layers, a dense layer 0,
biased selection)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.lfm2_moe import check_config, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "lfm2_moe", **tiny_config_kwargs("lfm2_moe"), **over}


@pytest.mark.parametrize("over", [
    {"tie_embedding": True},  # (the release's key for a tied head)
    {"conv_bias": True, "conv_L_cache": 4},
    {"use_expert_bias": False, "norm_topk_prob": False, "num_dense_layers": 0}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "lfm2_moe", over, PROMPT)


def test_release_names_map_to_the_canonical_ones() -> None:
    pairs = {"model.layers.0.conv.conv.weight": "model.layers.0.self_attn.conv.weight",
             "model.layers.0.conv.in_proj.weight": "model.layers.0.self_attn.in_proj.weight",
             "model.layers.1.self_attn.out_proj.weight": "model.layers.1.self_attn.o_proj.weight",
             "model.layers.1.self_attn.q_layernorm.weight": "model.layers.1.self_attn.q_norm.weight",
             "model.layers.0.feed_forward.w3.weight": "model.layers.0.mlp.up_proj.weight",
             "model.layers.2.feed_forward.expert_bias": "model.layers.2.mlp.gate.e_score_correction_bias",
             "model.layers.2.feed_forward.experts.5.w2.weight": "model.layers.2.mlp.experts.5.w2.weight",
             "model.layers.2.operator_norm.weight": "model.layers.2.input_layernorm.weight",
             "model.layers.2.ffn_norm.weight": "model.layers.2.post_attention_layernorm.weight",
             "model.embedding_norm.weight": "model.norm.weight"}
    assert {k: sanitize(k) for k in pairs} == pairs


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["conv", "full_attention"]}, "layer_types"),
    ({"layer_types": ["conv", "sliding_attention", "conv"]}, "layer_types"),
    ({"conv_L_cache": 1}, "conv_L_cache"),
    ({"num_dense_layers": 3}, "num_dense_layers"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme,over", [("int8", {}), ("int4", {}), ("int8", {"conv_bias": True})])
def test_decode_rows_in_the_kernels_give_the_torch_bits(ckpt, monkeypatch, scheme: str, over: dict) -> None:
    """kernels/conv.c, as the whole conv block (coli_conv_block) or the gating and convolution alone
    (coli_conv_rows), gives the bits of ShortConv's torch form, step after step; every conv layer took the block."""
    from colibri.models.lfm2_moe import ShortConv

    def logits(llm, mode: str) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            if mode == "rows":
                mp.setattr(ShortConv, "fused", lambda self, *a: None)
            elif mode == "torch":
                mp.setattr(ShortConv, "_native_rows", lambda self, *a: False)
            else:
                mp.setattr(ShortConv, "fused", _spy(ShortConv.fused, taken))
            logits = prompt_then_decode(llm, PROMPT)
        n_conv = sum(isinstance(b.self_attn, ShortConv) for b in llm.model.model.layers)
        # (the chunk's rows are not decode rows: its conv layers take torch, every later step's the block)
        assert mode != "block" or (len(taken) > n_conv and not any(taken[:n_conv]) and all(taken[n_conv:]))
        return logits

    with colibri.load(ckpt.coli("lfm2_moe", scheme, **over), ctx_size=64, threads=2) as llm:
        rows = logits(llm, "rows")  # (biased projections: the block declines, the rows' call takes the convolution)
        assert torch.equal(rows, logits(llm, "torch")) and (bool(over) or torch.equal(rows, logits(llm, "block")))
