"""Ling 3.0 hybrid (bailing_hybrid): the variants the tiny model does not take (Kimi's softplus decay instead of the
bounded one, transformers' default layer groups, explicit layer lists with two dense layers, YaRN) against
transformers' logits and greedy tokens; the decay and the head gate against transformers' modules; a slot's bytes;
the release's names; its MTP layer dropped with --no-mtp; refusals. KDA's kernels for both KDA families:
tests/test_kda.py; chunked prompts, batches and caching off: tests/test_state_models.py. Its oracle, batch, tier and
kernel-accuracy tests run with every family's (tests/tiny_configs.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, hf_logits, load_hf, tiny_config_kwargs, top2_margins
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.layers.mla import MLAttention
from colibri.models import bailing_hybrid
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
# transformers' prompts take its chunked KDA, ours the recurrence, and a bounded decay keeps more of the state (larger
# sums): on the 6-layer variant transformers' own f32 logits are 6.1e-4 from its f64 ones, ours 4.9e-4
BOUND = 1e-3


def _cfg(**over) -> dict:
    return {"model_type": "bailing_hybrid", **tiny_config_kwargs("bailing_hybrid"), **over}


@pytest.mark.parametrize("over", [
    {"kda_safe_gate": False},  # (Kimi's decay: -exp(A_log) softplus(f + dt_bias))
    {"layer_group_size": 6, "num_hidden_layers": 6},  # (transformers' default groups: full attention in layer 5)
    {"layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
     "mlp_layer_types": ["dense", "dense", "sparse", "sparse"], "kda_lower_bound": -1.5},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.8, "mscale_all_dim": 0.6}}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    hf = load_hf(ckpt.hf("bailing_hybrid", **over))
    model, _ = build("bailing_hybrid", json.loads((ckpt.hf("bailing_hybrid", **over) / "config.json").read_text()))
    assert [type(b.self_attn).__name__ for b in model.model.layers] == [
        "GatedMLAttention" if k == "full_attention" else "KimiDeltaAttention" for k in hf.config.layer_types]
    assert [type(b.mlp).__name__ == "MLP" for b in model.model.layers] == [
        k == "dense" for k in hf.config.mlp_layer_types]
    matches_transformers(ckpt, "bailing_hybrid", over, PROMPT, BOUND, hf=hf)


def test_a_config_as_released_reads_as_transformers_reads_it(ckpt, tmp_path) -> None:
    """A config without transformers' derived fields (no `layer_types` / `mlp_layer_types`: the groups and
    `first_k_dense_replace`; no `linear_*`: `head_dim` is the KDA heads' width, as before transformers' post-init
    sets it to the rope width) converts to the model transformers builds: kinds and logits."""
    from transformers import BailingHybridConfig

    from colibri.convert.converter import convert

    src = ckpt.hf("bailing_hybrid")
    released = edited_copy(src, tmp_path / "released", drop=("layer_types", "mlp_layer_types", "linear_head_dim",
                                                             "linear_num_heads", "linear_conv_kernel_dim"),
                           head_dim=16)
    cfg = json.loads((released / "config.json").read_text())
    assert bailing_hybrid.layer_kinds(cfg, 4) == BailingHybridConfig(num_hidden_layers=4,
                                                                     layer_group_size=3).layer_types
    with colibri.load(convert(released, tmp_path / "m.coli", "f32", progress=False), ctx_size=64, threads=2) as llm:
        assert [type(b.self_attn).__name__ for b in llm.model.model.layers] == [
            "KimiDeltaAttention", "KimiDeltaAttention", "GatedMLAttention", "KimiDeltaAttention"]
        assert (llm.logits(PROMPT * 3).float() - hf_logits(load_hf(src), PROMPT * 3)).abs().max() < BOUND


def test_the_decay_and_the_head_gate_are_transformers(ckpt) -> None:
    """A KDA layer's decay (bounded, and Kimi's form) = BailingHybridForgetGate's; the MLA layer's gated heads =
    transformers' gate on the same heads' output (the layers' own weights, bound from the converted file)."""

    hf = load_hf(ckpt.hf("bailing_hybrid"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    with colibri.load(ckpt.coli("bailing_hybrid", "f32"), ctx_size=64, threads=2) as llm:
        ours = llm.model.model.layers[0].self_attn
        theirs = hf.model.layers[0].self_attn.forget_gate
        for safe in (True, False):
            theirs.safe_gate = safe
            ours.a.lower_bound = theirs.lower_bound if safe else 0.0
            want = theirs(x[None])[0]  # [T, H, D]
            f = (ours._f(x) + ours.dt_bias).view(5, ours.a.heads, -1)
            rate = ours.A_log.view(-1, 1).exp()
            got = ours.a.lower_bound * torch.sigmoid(rate * f) if safe else -rate * torch.nn.functional.softplus(f)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        mla = llm.model.model.layers[2].self_attn
        o = torch.randn(5, 4 * 16, generator=g)
        gate = torch.sigmoid(hf.model.layers[2].self_attn.g_proj(x).float())
        torch.testing.assert_close(mla.out_gate(x, o), (o.view(5, 4, 16) * gate[..., None]).view(5, -1))


def test_a_slot_counts_latents_and_states() -> None:
    """The MLA layer's latent per position, each KDA layer's conv inputs (bf16) and f32 state [H, D, D]."""
    model, _ = build("bailing_hybrid", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == (16 + 8) * 2  # one MLA layer: kv_lora_rank + qk_rope_head_dim, bf16
    assert fixed == 3 * (3 * 64 * 3 * 2 + 4 * 16 * 16 * 4)  # three KDA layers: [3 H D, K-1] bf16, [H, D, D] f32


def test_release_names_map_to_the_canonical_ones() -> None:
    pairs = {"model.word_embeddings.weight": "model.embed_tokens.weight",
             "model.layers.0.attention.dense.weight": "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.attention.f_proj.weight": "model.layers.0.self_attn.f_proj.weight",
             "model.layers.0.attention.A_log": "model.layers.0.self_attn.A_log",
             "model.layers.0.attention.q_conv1d.weight": "model.layers.0.self_attn.q_conv1d.weight",
             "model.layers.0.self_attn.forget_gate.dt_bias": "model.layers.0.self_attn.dt_bias",
             "model.layers.2.attention.g_proj.weight": "model.layers.2.self_attn.g_proj.weight",
             "model.layers.2.attention.kv_a_proj_with_mqa.weight": "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
             "model.layers.1.mlp.gate.expert_bias": "model.layers.1.mlp.gate.e_score_correction_bias",
             "model.layers.1.mlp.experts.3.gate_proj.weight": "model.layers.1.mlp.experts.3.gate_proj.weight",
             "model.layers.1.mlp.shared_experts.up_proj.weight": "model.layers.1.mlp.shared_experts.up_proj.weight",
             "lm_head.weight": "lm_head.weight"}
    assert {k: bailing_hybrid.sanitize(k) for k in pairs} == pairs


def test_the_per_expert_checkpoint_carries_the_release_names(ckpt) -> None:
    """The oracle's per-expert folder is saved under the release's names (so converting it tests them)."""
    from safetensors import safe_open

    with safe_open(str(ckpt.hf("bailing_hybrid") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.word_embeddings.weight" in names and "model.layers.0.attention.dense.weight" in names
    assert "model.layers.0.attention.q_conv1d.weight" in names and "model.layers.1.mlp.gate.expert_bias" in names


def test_the_mtp_layer_is_dropped_with_no_mtp(ckpt, tmp_path) -> None:
    """Dropped and listed with --no-mtp (kept otherwise: tests/test_spec_mtp.py)."""
    src = edited_copy(ckpt.hf("bailing_hybrid"), tmp_path / "src")
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]

    def mtp(base: dict) -> dict:  # an MTP module: a decoder layer at n (as the last) with its own norms
        return {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in base.items()
                if k.startswith(f"model.layers.{n - 1}.")} | {f"model.layers.{n}.enorm.weight": torch.ones(64)}

    converts_dropping(src, mtp, ckpt.coli("bailing_hybrid", "f32"), tmp_path / "m.coli", PROMPT, keep_mtp=False)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_group_size": 0}, "layer_group_size"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"num_experts": 6, "num_expert_group": 4}, "n_group"),
    ({"kda_lower_bound": 0.5}, "kda_lower_bound"),
    ({"short_conv_kernel_size": 1, "linear_conv_kernel_dim": 1}, "short_conv_kernel_size"),
    ({"q_lora_rank": 24}, "q_lora_rank"),
    ({"no_kda_lora": False}, "no_kda_lora"),
    ({"gated_attention_proj_granularity_type": "element_wise"}, "gated_attention_proj_granularity_type"),
    ({"expert_swiglu_limit_list": [None, 7.0, None, None]}, "expert_swiglu_limit_list"),
    ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    bailing_hybrid.check_config(_cfg())  # the tiny config itself is fine
    bailing_hybrid.check_config(_cfg(kda_safe_gate=False, kda_lower_bound=0.5))  # (no bound without the safe gate)
    bailing_hybrid.check_config(_cfg(no_kda_lora=True, gated_attention_proj_granularity_type="head_wise",
                                     expert_swiglu_limit_list=[None] * 4, moe_shared_expert_intermediate_size=32))
    with pytest.raises(ColibriError, match=field):
        bailing_hybrid.check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_gated_mla_layer_runs_in_the_native_block(ckpt, monkeypatch, scheme: str) -> None:
    """bf16 decode rows: the MLA layer with its head gate in kernels/mla.c's block (the spy counts it at every step),
    against the layer in torch to bf16 rounding, the same top token wherever rounding cannot flip it; the block
    without the gate is another layer (so the comparison sees the gate)."""

    def logits(llm, mode: str) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            mp.setattr(bailing_hybrid.GatedMLAttention, "fused",
                       (lambda *a: None) if mode == "torch" else _spy(MLAttention.fused, taken))
            if mode == "ungated":
                mp.setattr(bailing_hybrid.GatedMLAttention, "_build_native_layer",
                           MLAttention._build_native_layer)
            llm.model.model.layers[2].self_attn._fused_layer = None
            out = prompt_then_decode(llm, PROMPT, first=1)  # (every position a one-row step)
            llm.model.model.layers[2].self_attn._fused_layer = None
        if mode != "torch":
            assert taken == [True] * len(PROMPT)
        return out

    with colibri.load(ckpt.coli("bailing_hybrid", scheme), ctx_size=64, threads=2) as llm:
        got, ref, ungated = logits(llm, "native"), logits(llm, "torch"), logits(llm, "ungated")
    err = (got - ref).abs().max()
    assert err < 0.05 * ref.abs().max() and (ungated - ref).abs().max() > 4 * err
    sure = top2_margins(ref) > 2 * (got - ref).abs().max(-1).values
    assert sure.sum() >= len(PROMPT) // 2 and torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])
