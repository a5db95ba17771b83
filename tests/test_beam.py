"""Reflection's Beam (`beam`). The oracle, batch, tier, prompt-cache and kernel-accuracy tests run it with every
family (tests/tiny_configs.py: sandwich norms, the gated attention with its bias a head, sliding layers with RoPE
and a full one without, the depth-scaled residual adds, a dense layer 0, DeepSeek-V3's grouped router, the soft-cap;
test_native_step.py its one-call step). Here: variants against transformers' logits and greedy tokens, the
positions where the NoPE layers' query scale matters (f32 against transformers, the kernels' block against the
torch layer), the default layer rules, names, refusals."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_logits, load_hf, tiny_config_kwargs
from oracle_check import matches_transformers

import colibri
from colibri.engine import native_step
from colibri.engine.decode_plan import DecodePlan
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.layers.attention import OutGate
from colibri.models import beam
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


@pytest.mark.parametrize("over", [
    # a large eps: each norm's depth-scaled eps matters (with the release's 1e-6 it hardly shows); no soft-cap
    {"rms_norm_eps": 0.05, "final_logit_softcapping": None},
    # RoPE on the full layer too (then no query scale), a router without renormalising in 4 groups of which 2 kept
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 5e4}},
     "norm_topk_prob": False, "n_group": 4, "topk_group": 2},
    # two full layers around a sliding one, two dense layers, YaRN on the sliding layers
    {"num_hidden_layers": 4, "layer_types": ["full_attention", "sliding_attention", "full_attention",
                                             "sliding_attention"],
     "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
     "rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                               "original_max_position_embeddings": 64},
                         "full_attention": None}},
])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "beam", over, PROMPT)


def test_the_query_scale_is_transformers_far_out(ckpt) -> None:
    """Positions past 2,000, where the full layer's query scale is ~1.08 (f32 against transformers: the table's
    entries are transformers' values), and the scale itself at every position to 2^20."""
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    pos = torch.arange(1 << 20)[None]
    want = compute_attention_scaling(pos).flatten()
    model, _ = build("beam", {**tiny_config_kwargs("beam")})
    table = next(b.self_attn.temp for b in model.model.layers if b.self_attn.has_table)
    assert torch.equal(table[1:1 + (1 << 20)], want)
    ids = [(7 * i + 3) % 380 + 4 for i in range(2100)]
    ref = hf_logits(load_hf(ckpt.hf("beam")), ids)[-40:]
    with colibri.load(ckpt.coli("beam", "f32"), ctx_size=2200, threads=2) as llm:
        got = llm.logits(ids).float()[-40:]
    assert (got - ref).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_positions_past_the_table_take_the_formula() -> None:
    """Past the table (cut to 16 entries here) the torch layer computes the same f32 values, and the block's limit
    follows."""
    from colibri.layers.batch import LayerKV

    model, _ = build("beam", {**tiny_config_kwargs("beam")})
    attn = model.model.layers[1].self_attn
    q = torch.randn(5, 4, 16)
    kv = LayerKV([(0, 5, 40, None)], 40)
    want = attn.scaled_queries(q, kv)
    attn.temp = attn.temp[:16].clone()
    assert attn.pos_limit() == 15
    assert torch.equal(attn.scaled_queries(q, kv), want)
    assert not torch.equal(want, q)


@pytest.mark.parametrize("n", range(1, 14))
def test_default_layer_rules_are_transformers(n: int) -> None:
    """Without layer lists: every sixth layer full and the last; three dense layers first (fewer when shorter)."""
    from transformers import BeamConfig

    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
           "num_hidden_layers": n, "num_experts": 8, "n_group": 2, "topk_group": 1}
    want = BeamConfig(**cfg)
    args = beam.ModelArgs.from_dict(cfg)
    assert args.layer_types == want.layer_types and args.mlp_layer_types == want.mlp_layer_types


def test_layers_read_the_stream_at_their_depth() -> None:
    """Each norm reading the residual stream has eps times its depth (module docstring); the full layers alone hold
    the query-scale table, one tensor for all; RoPE only where the layer kind has it; the step is one call."""
    cfg = {**tiny_config_kwargs("beam"), "rms_norm_eps": 1e-5}
    model, _ = build("beam", cfg)
    blocks = model.model.layers
    assert [b.input_layernorm.eps for b in blocks] == pytest.approx([1e-5, 3e-5, 5e-5])
    assert [b.post_attention_layernorm.eps for b in blocks] == pytest.approx([2e-5, 4e-5, 6e-5])
    assert model.model.norm.eps == pytest.approx(7e-5)
    assert all(b.self_attn.out_norm.eps == 1e-5 and b.mlp.out_norm.eps == 1e-5 for b in blocks)
    assert [b.self_attn.has_table for b in blocks] == [False, True, False]
    assert [b.self_attn.a.positions.use_rope for b in blocks] == [True, False, True]
    assert [b.self_attn.a.scores.sliding_window for b in blocks] == [8, None, 8]
    assert native_step.one_call_shape(blocks)


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_each_layer_in_the_block_is_the_torch_layer(ckpt, scheme: str) -> None:
    """Layer by layer on the same rows at positions 20000-20005 (the full layer's query scale ~1.25): the native
    block's (h + attention, post norm) against the torch layer's to bf16 rounding; with the gate's bias or the
    query scale left out of the block the layers differ far more (so the comparison sees them)."""
    from colibri.layers.batch import LayerKV

    g, start = torch.Generator().manual_seed(0), 20000
    with colibri.load(ckpt.coli("beam", scheme), ctx_size=64, threads=2) as llm:
        for b in llm.model.model.layers:
            m, h = b.self_attn, (torch.randn(6, 64, generator=g) * 2).to(torch.bfloat16)
            m.gate_bias.mul_(8)  # (the tiny model's biases, std 0.12, move the gates less than int8's noise)
            args = (b.input_layernorm, b.post_attention_layernorm)
            past = [(torch.randn(2, start, 16, generator=g) * 3).to(torch.bfloat16) for _ in range(2)]  # keys, values
            kv = []
            for _ in range(4):
                cache = m.make_cache(start + 6, torch.bfloat16)
                cache.k[:, :start], cache.v[:, :start] = past  # (the positions before: what the scale weighs)
                kv.append(LayerKV([(0, 6, start, cache)], start))
            h_ref = h + m(b.input_layernorm(h), kv[0])
            x_ref = b.post_attention_layernorm(h_ref)
            m._fused_layer = None
            h_got, x_got = m.fused(h, kv[1], *args)
            offs = []
            layer = m._native_layer(*args)
            # (each of Beam's two extras off in turn: the gate's bias, the positions' temperature table)
            for struct, field in [(layer.gate.contents, "bias")] + ([(layer, "positions")] if m.has_table else []):
                kept = getattr(struct, field)
                setattr(struct, field, None)
                offs.append(m.fused(h, kv[2 + len(offs)], *args))
                setattr(struct, field, kept)
            m._fused_layer = None
            for i, (got, ref) in enumerate(((h_got, h_ref), (x_got, x_ref))):
                err = (got.float() - ref.float()).abs().max()
                assert err <= 0.02 * ref.float().abs().max()
                for off in offs:
                    assert (off[i].float() - ref.float()).abs().max() > 4 * err


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_the_native_blocks_take_beams_layers(ckpt) -> None:
    """int8: every layer's attention in the block with the gate's bias (and the full layer's table), every MLP
    half with its output norm, and the whole step in one call."""
    with colibri.load(ckpt.coli("beam", "int8"), ctx_size=64, threads=2) as llm:
        m = llm.model
        for b in m.model.layers:
            layer = b.self_attn._native_layer(b.input_layernorm, b.post_attention_layernorm)
            assert layer is not None and layer.gate.contents.kind == OutGate.Q_SIGMOID and layer.gate.contents.bias
            assert bool(layer.positions) == b.self_attn.has_table
            assert layer.in_eps == pytest.approx(b.input_layernorm.eps)
        plan = DecodePlan(m).native_layers()
        assert plan is not None and native_step.tail(m) is not None
        assert native_step.tail(m).struct.eps == pytest.approx(m.model.norm.eps)


def test_names() -> None:
    layer = "model.layers.4."
    for hf, ours in (("post_attention_layernorm.weight", "self_attn.out_norm.weight"),
                     ("pre_feedforward_layernorm.weight", "post_attention_layernorm.weight"),
                     ("post_feedforward_layernorm.weight", "mlp.out_norm.weight"),
                     ("input_layernorm.weight", "input_layernorm.weight"),
                     ("self_attn.gate_bias", "self_attn.gate_bias"),
                     ("mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias")):
        assert beam.sanitize(layer + hf) == layer + ours


@pytest.mark.parametrize("change, want", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types.*3 entries"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types.*dense / sparse"),
    ({"attention_bias": True}, "attention_bias"),
    ({"n_group": 3}, "n_group.*divisor"),
    ({"n_group": None}, "n_group"),
    ({"topk_group": 3}, "topk_group.*1 to n_group"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 4}, "topk_group.*enough"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "longrope", "rope_theta": 1e4},
                          "full_attention": None}}, "rope_type"),
])
def test_refusals(change: dict, want: str) -> None:
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "num_experts": 8, "n_group": 2,
           "topk_group": 1, "num_experts_per_tok": 2, **change}
    with pytest.raises(ColibriError, match=f"beam.*{want}"):
        beam.check_config(cfg)
