"""A.X K2 (axk2): the variants the tiny model (A.X-K2-Light's shape: no router groups) does not take (grouped
routing, MoE layers from the legacy `first_k_dense_replace` / `moe_layer_freq`) against transformers' logits and
greedy tokens; the router's 0.0 mask and the gated norm against transformers' modules; names; refusals. Its oracle,
batch, tier, prompt-cache and kernel-accuracy tests run with every family's (tests/tiny_configs.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import edited_copy, hf_logits, load_hf, tiny_config_kwargs, top2_margins
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models import axk2
from colibri.models import deepseek_v32 as v32
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "axk2", **tiny_config_kwargs("axk2"), **over}


@pytest.mark.parametrize("over", [
    {"n_group": 2, "topk_group": 1},  # (the larger releases' grouped routing)
    {"mlp_layer_types": ["dense", "sparse", "dense"], "index_topk": 4}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "axk2", over, PROMPT)


def test_legacy_layer_fields_read_as_transformers_reads_them(ckpt, tmp_path) -> None:
    """A config with `first_k_dense_replace` / `moe_layer_freq` instead of `mlp_layer_types` (what
    AXK2Config converts from) gives transformers' layer kinds and its logits."""
    from transformers import AXK2Config

    from colibri.convert.converter import convert

    over = {"mlp_layer_types": ["sparse", "dense", "sparse"]}  # (= first_k_dense_replace 0, moe_layer_freq 2)
    src = ckpt.hf("axk2", **over)
    legacy = edited_copy(src, tmp_path / "legacy", drop=("mlp_layer_types",), first_k_dense_replace=0,
                         moe_layer_freq=2)
    cfg = json.loads((legacy / "config.json").read_text())
    assert axk2.mlp_kinds(cfg, 3) == AXK2Config(num_hidden_layers=3, first_k_dense_replace=0,
                                                moe_layer_freq=2).mlp_layer_types == over["mlp_layer_types"]
    with colibri.load(convert(legacy, tmp_path / "m.coli", "f32", progress=False), ctx_size=64, threads=2) as llm:
        assert [type(b.post_attention_layernorm).__name__ for b in llm.model.model.layers] == [
            "GatedRMSNorm", "RMSNorm", "GatedRMSNorm"]
        assert (llm.logits(PROMPT * 3).float() - hf_logits(load_hf(src), PROMPT * 3)).abs().max() < 1e-4


def test_grouped_routing_masks_the_other_groups_with_zero() -> None:
    """Where the kept groups' experts score below 0 for the choice (negative selection biases), transformers'
    router takes experts of the dropped groups (masked to 0.0, not -inf): ours picks the same experts and weights,
    and DeepSeek-V3's rule would not (so the case is real)."""
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2TopkRouter

    from colibri.models import deepseek_v3 as v3

    cfg = AXK2Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     num_hidden_layers=1)
    g = torch.Generator().manual_seed(0)
    theirs = AXK2TopkRouter(cfg)
    theirs.weight.data = torch.randn(8, 16, generator=g) * 0.1
    theirs.e_score_correction_bias.data = torch.tensor([-0.9, -0.9, -0.9, 0.3, -0.9, -0.9, -0.9, -0.8])
    args = axk2.ModelArgs.from_dict(_cfg(hidden_size=16, n_routed_experts=8, n_group=2, topk_group=1))
    ours, plain = axk2.Router(args), v3.Router(args)
    for r in (ours, plain):
        r.weight.data, r.e_score_correction_bias.data = theirs.weight.data, theirs.e_score_correction_bias.data
    assert ours.native_routing() is None  # (the kernels' rule drops the other groups)
    x = torch.randn(6, 16, generator=g)
    _, w_want, i_want = theirs(x)
    i_got, w_got = ours(x)
    assert torch.equal(i_got.sort(-1).values, i_want.sort(-1).values.long())
    torch.testing.assert_close(w_got.gather(1, i_got.argsort(-1)), w_want.gather(1, i_want.long().argsort(-1)))
    assert not torch.equal(plain(x)[0].sort(-1).values, i_got.sort(-1).values)


def test_the_gated_norm_is_transformers() -> None:
    from transformers import AXK2Config
    from transformers.models.axk2.modeling_axk2 import AXK2GatedRMSNorm

    theirs = AXK2GatedRMSNorm(AXK2Config(hidden_size=16, gated_norm_rank=4, num_hidden_layers=1))
    ours = axk2.GatedRMSNorm(16, 4, theirs.norm.variance_epsilon)
    g = torch.Generator().manual_seed(1)
    for p in theirs.parameters():
        p.data = torch.randn(p.shape, generator=g)
    ours.norm.weight.data = theirs.norm.weight.data
    for mine, hf in ((ours.W_down, theirs.mlp.fc1), (ours.W_up, theirs.mlp.fc2)):
        mine.forward = hf.forward  # (placeholders until a store binds them: transformers' own linears)
    x = torch.randn(5, 16, generator=g)
    torch.testing.assert_close(ours(x), theirs(x))


def test_release_names_are_canonical_and_transformers_names_map_to_them() -> None:
    pairs = {"model.layers.0.self_attn.q_gate_proj.weight": "model.layers.0.self_attn.q_b_proj.weight",
             "model.layers.0.self_attn.q_b_proj.weight": "model.layers.0.self_attn.q_b_proj.weight",
             "model.layers.0.input_layernorm.mlp.fc1.weight": "model.layers.0.input_layernorm.W_down.weight",
             "model.layers.1.post_attention_layernorm.mlp.fc2.weight":
                 "model.layers.1.post_attention_layernorm.W_up.weight",
             "model.layers.1.input_layernorm.W_up.weight": "model.layers.1.input_layernorm.W_up.weight",
             "model.layers.1.mlp.shared_experts.up_proj.weight": "model.layers.1.mlp.shared_experts.up_proj.weight",
             "model.layers.1.self_attn.indexer.wq_b.weight": "model.layers.1.self_attn.indexer.wq_b.weight"}
    assert {k: axk2.sanitize(k) for k in pairs} == pairs
    model, _ = build("axk2", _cfg())
    names = {n for n, _ in model.named_modules()}
    assert "model.layers.0.self_attn.q_b_proj" in names and "model.layers.1.post_attention_layernorm.W_up" in names
    assert "model.layers.0.post_attention_layernorm.W_up" not in names  # (a dense layer's post norm is plain)


@pytest.mark.parametrize("over,field", [
    ({"n_group": 2}, "topk_group"),
    ({"topk_group": 1}, "topk_group"),
    ({"n_group": 3, "topk_group": 1}, "n_group"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"gated_norm_rank": 0}, "gated_norm_rank"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    axk2.check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        axk2.check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_the_gated_layers_run_in_the_native_block(ckpt, monkeypatch) -> None:
    """int8, bf16 decode rows: every layer's attention in kernels/mla.c's block with the gated norms, the gated query
    and the output gate (the spy counts each layer at every step, past index_topk positions too), against the layers
    in torch to bf16 rounding, the same top token wherever rounding cannot flip it."""

    def logits(llm, native_path: bool) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            mp.setattr(axk2.GatedQueryAttention, "fused",
                       _spy(v32.DSAttention.fused, taken) if native_path else (lambda *a: None))
            out = prompt_then_decode(llm, PROMPT, first=1)  # (every position a one-row step)
        if native_path:  # (past index_topk positions too: the block over the selected latents)
            assert taken == [True] * (len(PROMPT) * len(llm.model.model.layers))
        return out

    with colibri.load(ckpt.coli("axk2", "int8"), ctx_size=64, threads=2) as llm:
        got, ref = logits(llm, True), logits(llm, False)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    sure = top2_margins(ref) > 2 * (got - ref).abs().max(-1).values
    assert sure.sum() >= len(PROMPT) // 2 and torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_each_gated_layer_in_the_block_is_the_torch_layer(ckpt, scheme: str) -> None:
    """Layer by layer on the same input rows (a prompt of 6): the native block's (h + attention, post norm)
    against the torch layer's to bf16 rounding, for a dense layer (plain post norm) and the MoE layers (gated); with
    the norms' gates off in the block the layers differ far more (so the comparison sees them). (End to end at int4
    a router's near tie can flip an expert at a position: the layer-level check is the exact one.)"""
    from colibri.layers.batch import LayerKV

    over = {"q_lora_rank": 32} if scheme == "int4" else {}  # (int4: q_b_proj reads 2 q_lora, in groups of 32)
    g = torch.Generator().manual_seed(0)
    with colibri.load(ckpt.coli("axk2", scheme, **over), ctx_size=64, threads=2) as llm:
        for b in llm.model.model.layers:
            m, h = b.self_attn, (torch.randn(6, 64, generator=g) * 2).to(torch.bfloat16)  # (6 positions: a prompt)
            args = (b.input_layernorm, b.post_attention_layernorm)
            kv = [LayerKV([(0, 6, 0, m.make_cache(64, torch.bfloat16))], 0) for _ in range(3)]
            h_ref = h + m(b.input_layernorm(h), kv[0])
            x_ref = b.post_attention_layernorm(h_ref)
            m._fused_layer = None
            h_got, x_got = m.fused(h, kv[1], *args)
            m._native_layer(*args).gate_rank = 0
            h_off, x_off = m.fused(h, kv[2], *args)
            m._fused_layer = None
            for got, ref, off in ((h_got, h_ref, h_off), (x_got, x_ref, x_off)):
                err = (got.float() - ref.float()).abs().max()
                assert err <= 0.02 * ref.float().abs().max() and (off.float() - ref.float()).abs().max() > 4 * err
