"""Nemotron-H (nemotron_h): the variants the tiny model does not take (the older pattern-string config with Mamba
names, biased projections and MLPs, one router group, a time-step floor that clamps prompts) against transformers'
logits and greedy tokens; a slot's bytes; the release's names; refusals (chunked prompts, batches and prompt
caching off: tests/test_state_models.py); the ungated relu^2 experts in the kernels against torch. Its oracle, batch,
tier and kernel-accuracy tests run with every family's (tests/tiny_configs.py: Mamba-2, experts, attention, MLP,
Mamba-2, experts)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from oracle_check import matches_transformers

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.base import build
from colibri.models.nemotron_h import check_config, layer_kinds, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "nemotron_h", **tiny_config_kwargs("nemotron_h"), **over}


@pytest.mark.parametrize("over", [
    {"layers_block_type": None, "hybrid_override_pattern": "ME*-ME", "mamba_n_groups": 1, "mamba_d_conv": 3},
    {"use_bias": True, "mlp_bias": True, "use_conv_bias": False, "n_group": 1, "norm_topk_prob": False},
    {"time_step_min": 0.5},  # (clamps most of the tiny model's prompt steps; decode steps are not clamped)
    {"moe_latent_size": 32, "mlp_bias": True}])  # (Nemotron 3 Super's latent experts, projections biased)
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "nemotron_h", over, PROMPT)


def test_a_slot_counts_its_states_and_kv() -> None:
    """K/V per position for the attention layer, a fixed state for each Mamba layer, nothing for the feed-forward
    layers (CausalLM.cache_cost)."""
    model, _ = build("nemotron_h", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == 2 * 2 * 16 * 2  # the attention layer's K and V: 2 kv heads of 16, bf16
    conv_dim = 4 * 32 + 2 * 2 * 16  # x (4 heads of 32), B and C (2 groups of 16 states)
    assert fixed == 2 * (conv_dim * 3 * 2 + 4 * 32 * 16 * 4)  # two Mamba layers: conv inputs (bf16), f32 states


def test_release_names_and_layer_kinds() -> None:
    pairs = {"backbone.embeddings.weight": "model.embed_tokens.weight",
             "backbone.layers.0.mixer.in_proj.weight": "model.layers.0.mixer.in_proj.weight",
             "backbone.layers.1.mixer.experts.3.up_proj.weight": "model.layers.1.mixer.experts.3.up_proj.weight",
             "backbone.layers.1.mixer.gate.e_score_correction_bias":
                 "model.layers.1.mixer.gate.e_score_correction_bias",
             "backbone.layers.1.mixer.shared_experts.down_proj.weight":
                 "model.layers.1.mixer.shared_experts.down_proj.weight",
             "backbone.layers.2.norm.weight": "model.layers.2.norm.weight",
             "backbone.norm_f.weight": "model.norm.weight",
             "model.norm_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
    assert {k: sanitize(k) for k in pairs} == pairs
    # the MTP module's (vLLM's names: a step of two layers; tests/test_spec_mtp.py runs one)
    mtp = {"mtp.layers.0.mixer.q_proj.weight": "mtp.0.block.mixer.q_proj.weight",
           "language_model.mtp.layers.1.mixer.experts.3.up_proj.weight": "mtp.0.block1.mixer.experts.3.up_proj.weight",
           "mtp.layers.0.eh_proj.weight": "mtp.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight":
           "mtp.0.norm.weight", "mtp.layers.1.norm.weight": "mtp.0.block1.norm.weight"}
    assert {k: sanitize(k) for k in mtp} == mtp
    assert layer_kinds({"hybrid_override_pattern": "M-*E"}) == ["linear_attention", "mlp", "full_attention", "moe"]
    assert layer_kinds({"layers_block_type": ["mamba", "attention", "moe"]}) == \
        ["linear_attention", "full_attention", "moe"]


@pytest.mark.parametrize("over,field", [
    ({"layers_block_type": ["linear_attention", "full_attention", "mlp"]}, "layers_block_type"),  # (no experts)
    ({"layers_block_type": ["linear_attention", "sliding_attention", "moe"]}, "layers_block_type"),
    ({"layers_block_type": None}, "layers_block_type"),
    ({"num_hidden_layers": 5}, "num_hidden_layers"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ({"moe_latent_size": 0}, "moe_latent_size"),
    ({"n_group": 3}, "n_group"),
    ({"n_groups": 3}, "n_groups"),
    ({"conv_kernel": 1}, "conv_kernel"),
    ({"time_step_min": -1.0}, "time_step_min")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_ungated_experts_in_the_kernels_agree_with_torch(ckpt, monkeypatch, scheme: str) -> None:
    """The MoE layers in one native call each (kernels/moe.c coli_moe_block: the router, the ungated experts under
    ACT_RELU2 with gate_up holding the up rows alone, the ungated shared expert) against the experts' and the shared
    expert's torch forms over the same quantized weights, 24 prompt rows and 8 decode steps: logits to the kernels'
    rounding (their int8 activations: docs/QUANT.md), the top token of nearly every row the same; the fused call ran
    for both MoE layers of every step."""
    from colibri.layers import moe
    from colibri.models import nemotron_h

    def run(native_on: bool) -> tuple[torch.Tensor, int]:
        calls: list[int] = []
        real = moe.native.moe_block
        with monkeypatch.context() as mp:
            mp.setattr(moe.native, "moe_block", lambda *a, **k: calls.append(1) or real(*a, **k))
            if not native_on:
                mp.setattr(moe.SparseMoE, "fused", lambda self, x, h: None)
                mp.setattr(moe.SwitchGLU, "_native",
                           lambda self, x, idx, w, fetched: self._experts(x, idx, w, fetched))
                mp.setattr(nemotron_h.native_mlp, "run", lambda *a: None)
            # (a shared expert 64 wide: int4's groups of 32 divide its down_proj's inputs, so it stays int4)
            with colibri.load(ckpt.coli("nemotron_h", scheme, moe_shared_expert_intermediate_size=64), ctx_size=64,
                              threads=2) as llm:
                list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True))
                logits = llm.logits(PROMPT * 2).float()
        return logits, len(calls)

    (got, n), (ref, none) = run(True), run(False)
    assert n >= 2 * (1 + 7 + 1) and none == 0, (n, none)  # (two MoE layers: the prompt, 7 decode steps, 24 rows)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_ungated_mlp_in_the_kernels_gives_the_torch_bits(ckpt, monkeypatch, scheme: str) -> None:
    """coli_mlp_rows under ACT_RELU2 (the dense layer and the shared expert: up, relu^2 rounded once, down) gives the
    bits of Relu2MLP's torch form over the same native QLinears, for 1 to 5 bf16 rows."""
    from colibri.models import nemotron_h

    with colibri.load(ckpt.coli("nemotron_h", scheme, moe_shared_expert_intermediate_size=64), ctx_size=64,
                      threads=2) as llm:
        mlps = [b.mixer for b in llm.model.model.layers if b.kind == "mlp"]
        mlps += [b.mixer.shared_experts for b in llm.model.model.layers if b.kind == "moe"]
        g = torch.Generator().manual_seed(0)
        for m in mlps:
            for T in (1, 5):
                x = torch.randn(T, 64, generator=g).to(torch.bfloat16)
                with torch.inference_mode():
                    y = nemotron_h.native_mlp.run(m, x)
                    with monkeypatch.context() as mp:
                        mp.setattr(nemotron_h.native_mlp, "run", lambda *a: None)
                        ref = m(x)
                assert y is not None and torch.equal(y, ref)


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_latent_experts_run_in_the_kernels(ckpt, monkeypatch) -> None:
    """Nemotron 3 Super's latent MoE: the routed experts (over the 32-wide latent rows) in the MoE kernel, between
    the projections in their modules; the logits of 24 prompt rows and the decode steps agree with the experts' torch
    form to the kernels' rounding, the top token of nearly every row the same."""
    from colibri.layers import moe

    def run(native_on: bool) -> tuple[torch.Tensor, int]:
        calls: list[int] = []
        real = moe.native.moe
        with monkeypatch.context() as mp:
            mp.setattr(moe.native, "moe", lambda *a, **k: calls.append(1) or real(*a, **k))
            if not native_on:
                mp.setattr(moe.SwitchGLU, "_native",
                           lambda self, x, idx, w, fetched: self._experts(x, idx, w, fetched))
            with colibri.load(ckpt.coli("nemotron_h", "int8", moe_latent_size=32), ctx_size=64, threads=2) as llm:
                list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True))
                logits = llm.logits(PROMPT * 2).float()
        return logits, len(calls)

    (got, n), (ref, none) = run(True), run(False)
    assert n >= 2 * (1 + 7 + 1) and none == 0
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
