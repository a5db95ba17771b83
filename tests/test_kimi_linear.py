"""Kimi-Linear (kimi_linear): the variants the tiny model does not take (the released config's own names with
`linear_attn_config`'s 1-indexed layer lists, transformers' default layer kinds, no q LoRA) against transformers'
logits and greedy tokens; the KDA step against transformers' recurrence; a slot's bytes; names; refusals; the MLA
layers in the native block without rotation. KDA's kernels: tests/test_kda.py; chunked prompts, batches and caching
off: tests/test_state_models.py.
Its oracle, batch, tier and kernel-accuracy tests run with every family's (tests/tiny_configs.py)."""

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
from colibri.layers.kda import kda_step, l2norm
from colibri.layers.mla import MLAttention
from colibri.models import kimi_linear
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
# transformers' prompts take its chunked KDA, ours the recurrence (the same sums in another order), and the state
# carries every position's rounding: as Qwen3-Next's bound in tests/test_oracle.py
BOUND = 3e-4


def _cfg(**over) -> dict:
    return {"model_type": "kimi_linear", **tiny_config_kwargs("kimi_linear"), **over}


@pytest.mark.parametrize("over", [
    # KDA layers 1, 2 and 4 and full attention in 3 (1-indexed, as released), dense layers 1-2, no q LoRA
    {"layer_types": None, "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16,
                                                 "num_heads": 2, "short_conv_kernel_size": 3},
     "first_k_dense_replace": 2, "q_lora_rank": None},
    {"layer_types": None, "num_hidden_layers": 5}])  # (transformers' default: full attention in layer 4)
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    hf = load_hf(ckpt.hf("kimi_linear", **over))
    if "linear_attn_config" in over:
        assert hf.config.layer_types == ["linear_attention", "linear_attention", "full_attention",
                                         "linear_attention"]
    model, _ = build("kimi_linear", json.loads((ckpt.hf("kimi_linear", **over) / "config.json").read_text()))
    assert [type(b.self_attn).__name__ for b in model.model.layers] == [
        "NoPEMLAttention" if k == "full_attention" else "KimiDeltaAttention" for k in hf.config.layer_types]
    matches_transformers(ckpt, "kimi_linear", over, PROMPT, BOUND, hf=hf)


def test_the_released_config_reads_as_transformers_reads_it(ckpt, tmp_path) -> None:
    """A config as released (no `layer_types`: `linear_attn_config`'s 1-indexed lists and the KDA widths; no
    `mlp_layer_types`: the first layer dense by default) converts to the model transformers builds: kinds and logits."""
    from transformers import KimiLinearConfig

    lin = {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "head_dim": 16, "num_heads": 2,
           "short_conv_kernel_size": 4}
    assert kimi_linear.layer_kinds({"linear_attn_config": lin}, 4) == KimiLinearConfig(
        num_hidden_layers=4, linear_attn_config=lin).layer_types
    src = ckpt.hf("kimi_linear")
    released = edited_copy(src, tmp_path / "released", drop=("layer_types", "mlp_layer_types", "linear_head_dim",
                                                             "linear_num_heads", "linear_conv_kernel_dim",
                                                             "first_k_dense_replace"),  # (its default: 1)
                           linear_attn_config=lin)
    from colibri.convert.converter import convert

    with colibri.load(convert(released, tmp_path / "m.coli", "f32", progress=False), ctx_size=64, threads=2) as llm:
        assert [type(b.self_attn).__name__ for b in llm.model.model.layers] == [
            "KimiDeltaAttention", "NoPEMLAttention", "KimiDeltaAttention", "KimiDeltaAttention"]
        assert (llm.logits(PROMPT * 3).float() - hf_logits(load_hf(src), PROMPT * 3)).abs().max() < BOUND


def test_the_kda_step_is_transformers_recurrence() -> None:
    """kda_step over a few positions from a non-zero state = transformers' recurrent_kimi_delta_attention."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    g = torch.Generator().manual_seed(0)
    T, H, D = 5, 3, 8
    q, k, v = (torch.randn(1, T, H, D, generator=g) for _ in range(3))
    gate = -torch.rand(1, T, H, D, generator=g)  # (log-decays per channel)
    beta = torch.rand(1, T, H, generator=g)
    S0 = torch.randn(1, H, D, D, generator=g)
    want, S_want = recurrent_kimi_delta_attention(q, k, v, gate, beta, S0.clone(), True, use_qk_l2norm_in_kernel=True)
    S, got = S0[0].clone(), []
    qn, kn = l2norm(q[0]) * D**-0.5, l2norm(k[0])
    for t in range(T):
        got.append(kda_step(qn[t], kn[t], v[0, t], gate[0, t], beta[0, t], S))
    torch.testing.assert_close(torch.stack(got), want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, S_want[0], rtol=1e-5, atol=1e-6)


def test_a_slot_counts_latents_and_states() -> None:
    """The MLA layer's latent per position, each KDA layer's conv inputs (bf16) and f32 state [H, D, D]."""
    model, _ = build("kimi_linear", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == (16 + 8) * 2  # one MLA layer: kv_lora_rank + qk_rope_head_dim, bf16
    assert fixed == 3 * (3 * 32 * 3 * 2 + 2 * 16 * 16 * 4)  # three KDA layers: [3 H D, K-1] bf16, [H, D, D] f32


def test_release_names_map_to_the_canonical_ones() -> None:
    pairs = {"model.layers.0.self_attn.forget_gate.f_a_proj.weight": "model.layers.0.self_attn.f_a_proj.weight",
             "model.layers.0.self_attn.forget_gate.A_log": "model.layers.0.self_attn.A_log",
             "model.layers.0.self_attn.f_b_proj.weight": "model.layers.0.self_attn.f_b_proj.weight",
             "model.layers.0.self_attn.q_conv1d.weight": "model.layers.0.self_attn.q_conv1d.weight",
             "model.layers.0.block_sparse_moe.gate_proj.weight": "model.layers.0.mlp.gate_proj.weight",
             "model.layers.1.block_sparse_moe.gate.e_score_correction_bias":
                 "model.layers.1.mlp.gate.e_score_correction_bias",
             "model.layers.1.block_sparse_moe.experts.3.w2.weight": "model.layers.1.mlp.experts.3.w2.weight",
             "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight":
                 "model.layers.1.mlp.shared_experts.up_proj.weight",
             "model.layers.1.self_attn.kv_b_proj.weight": "model.layers.1.self_attn.kv_b_proj.weight"}
    assert {k: kimi_linear.sanitize(k) for k in pairs} == pairs


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]}, "layer_types"),
    ({"layer_types": None, "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3]}}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"num_experts": 6, "num_expert_group": 4}, "n_group"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    kimi_linear.check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        kimi_linear.check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_the_mla_layer_runs_unrotated_in_the_native_block(ckpt, monkeypatch) -> None:
    """bf16 int8 decode rows: the MLA layer in kernels/mla.c's block with cos 1 / sin 0 tables (the spy counts it at
    every step), against the layer in torch to bf16 rounding, the same top token wherever rounding cannot flip it."""

    def logits(llm, native_path: bool) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            mp.setattr(kimi_linear.NoPEMLAttention, "fused",
                       _spy(MLAttention.fused, taken) if native_path else (lambda *a: None))
            out = prompt_then_decode(llm, PROMPT, first=1)  # (every position a one-row step)
        if native_path:
            assert taken == [True] * len(PROMPT)
        return out

    with colibri.load(ckpt.coli("kimi_linear", "int8"), ctx_size=64, threads=2) as llm:
        got, ref = logits(llm, True), logits(llm, False)
        tables = llm.model.model.layers[1].self_attn.rope.tables(5, 3, torch.float32)
    assert torch.equal(tables[0], torch.ones_like(tables[0])) and torch.equal(tables[1], torch.zeros_like(tables[1]))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    # the same top token wherever bf16 rounding cannot flip it (a step's top two within twice the difference can tie)
    sure = top2_margins(ref) > 2 * (got - ref).abs().max(-1).values
    assert sure.sum() >= len(PROMPT) // 2 and torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])
