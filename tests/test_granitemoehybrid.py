"""Granite 4.0-H (granitemoehybrid): the variants the tiny model does not take (RoPE on, one Mamba group, a clamped
time step, biased projections without a conv bias, one SSD chunk a prompt) against transformers' logits and greedy
tokens; the chunked SSD form against the recurrence; the release's names and layer kinds; refusals (chunked prompts,
batches and prompt caching off: tests/test_state_models.py). Its oracle, batch,
tier and kernel-accuracy tests run with every family's (tests/tiny_configs.py: Mamba, attention and Mamba layers,
2 groups, prompts over several SSD chunks)."""

from __future__ import annotations

import math

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.layers.mamba2 import ssd_chunked
from colibri.models.base import build
from colibri.models.granitemoehybrid import check_config, layer_kinds, sanitize, time_step_limit

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "granitemoehybrid", **tiny_config_kwargs("granitemoehybrid"), **over}


@pytest.mark.parametrize("over", [
    {"position_embedding_type": "rope"},
    {"mamba_n_groups": 1, "mamba_chunk_size": 256},  # (a whole prompt in one chunk)
    {"time_step_limit": [0.0, 0.5]},  # (clamps most of the tiny model's steps, in prompts only, as transformers)
    {"mamba_conv_bias": False, "mamba_proj_bias": True, "mamba_d_conv": 3}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "granitemoehybrid", over, PROMPT)


@pytest.mark.parametrize("n,chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (9, 64)])
def test_chunked_form_is_the_recurrence(n: int, chunk: int) -> None:
    """ssd_chunked from a non-zero state gives the outputs and the final state of the step-by-step recurrence."""
    g = torch.Generator().manual_seed(n * 31 + chunk)
    H, P, N = 3, 4, 5
    x, B, C = (torch.randn(n, H, d, generator=g) for d in (P, N, N))
    dt = torch.rand(n, H, generator=g) + 0.05
    A = -torch.rand(H, generator=g) - 0.1
    S0 = torch.randn(H, P, N, generator=g)
    S, ys = S0.clone(), []
    for t in range(n):
        S = S * (dt[t] * A).exp()[:, None, None] + dt[t, :, None, None] * x[t, :, :, None] * B[t, :, None, :]
        ys.append((S * C[t, :, None, :]).sum(-1))
    S1 = S0.clone()
    y = ssd_chunked(x, dt, A, B, C, S1, chunk)
    assert torch.allclose(y, torch.stack(ys), atol=1e-5, rtol=1e-5)
    assert torch.allclose(S1, S, atol=1e-5, rtol=1e-5)


def test_release_names_and_layer_kinds() -> None:
    pairs = {"model.layers.0.mamba.in_proj.weight": "model.layers.0.self_attn.in_proj.weight",
             "model.layers.0.mamba.conv1d.bias": "model.layers.0.self_attn.conv1d.bias",
             "model.layers.0.mamba.A_log": "model.layers.0.self_attn.A_log",
             "model.layers.0.mamba.norm.weight": "model.layers.0.self_attn.norm.weight",
             "model.layers.0.mamba.out_proj.weight": "model.layers.0.self_attn.out_proj.weight",
             "model.layers.1.block_sparse_moe.router.layer.weight": "model.layers.1.mlp.gate.weight",
             "model.layers.1.block_sparse_moe.input_linear.weight": "model.layers.1.mlp.experts.gate_up_proj",
             "model.layers.1.shared_mlp.output_linear.weight": "model.layers.1.mlp.shared_mlp.down_proj.weight"}
    assert {k: sanitize(k) for k in pairs} == pairs
    old = {"num_hidden_layers": 3, "layers_block_type": ["mamba", "attention", "mamba"]}
    assert layer_kinds(old) == ["linear_attention", "full_attention", "linear_attention"]
    check_config(_cfg(layer_types=None, **old))
    assert layer_kinds({"num_hidden_layers": 2}) == ["linear_attention"] * 2  # (transformers' default)
    assert time_step_limit({"time_step_limit": [0.0, {"__float__": "Infinity"}]}) == [0.0, math.inf]


def test_a_slot_counts_its_mamba_states() -> None:
    """What the planner and the --ctx-size check count (CausalLM.cache_cost): K/V per position for the attention
    layer, a fixed state for each Mamba layer."""
    model, _ = build("granitemoehybrid", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == 2 * 2 * 16 * 2  # the attention layer's K and V: 2 kv heads of 16, bf16
    conv_dim = 4 * 32 + 2 * 2 * 16  # x (4 heads of 32), B and C (2 groups of 16 states)
    assert fixed == 2 * (conv_dim * 3 * 2 + 4 * 32 * 16 * 4)  # two Mamba layers: conv inputs (bf16), f32 states


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]}, "layer_types"),
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"mamba_d_head": 16}, "mamba_d_head"),
    ({"mamba_n_heads": 3}, "mamba_d_head"),
    ({"mamba_n_groups": 3}, "mamba_n_groups"),
    ({"mamba_d_conv": 1}, "mamba_d_conv"),
    ({"mamba_d_state": 0}, "mamba_d_state"),
    ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
    ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, "time_step_limit"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme,over", [("int8", {}), ("int4", {}),
                                         ("int8", {"mamba_n_groups": 1, "mamba_conv_bias": False}),
                                         ("int8", {"mamba_proj_bias": True})])
def test_decode_rows_in_the_kernels_agree_with_the_torch_path(ckpt, monkeypatch, scheme: str, over: dict) -> None:
    """kernels/mamba.c on bf16 decode rows, step after step: the rows' call (coli_mamba_rows) agrees with the torch
    form to bf16 rounding (another summation order) and picks the same tokens; the whole block (coli_mamba_block)
    gives the rows' bits; every Mamba layer of every decode step took the call asked for (biased projections: the
    block declines, the rows' call runs)."""
    from colibri.kernels import native_mamba
    from colibri.layers import mamba2
    from colibri.layers.mamba2 import Mamba2Mixer

    def logits(llm, mode: str) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            if mode == "rows":
                mp.setattr(Mamba2Mixer, "fused", lambda self, *a: None)
                mp.setattr(mamba2.native_mamba, "mamba_rows", _spy(native_mamba.mamba_rows, taken))
            elif mode == "torch":
                mp.setattr(Mamba2Mixer, "_native_rows", lambda self, *a: False)
            else:
                mp.setattr(Mamba2Mixer, "fused", _spy(Mamba2Mixer.fused, taken))
            logits = prompt_then_decode(llm, PROMPT)
        n = sum(isinstance(b.self_attn, Mamba2Mixer) for b in llm.model.model.layers)
        # (the prompt's rows take torch; every later step's Mamba layers the block, unless biases stop it, or the
        # rows' call)
        steps = len(PROMPT) - 4
        assert mode != "block" or (len(taken) == n * (steps + 1) and not any(taken[:n])
                                   and all(taken[n:]) != bool(over.get("mamba_proj_bias")))
        assert mode != "rows" or len(taken) == n * steps
        return logits

    with colibri.load(ckpt.coli("granitemoehybrid", scheme, **over), ctx_size=64, threads=2) as llm:
        rows, ref = logits(llm, "rows"), logits(llm, "torch")
        assert torch.equal(rows, logits(llm, "block"))
        assert torch.equal(rows.argmax(-1), ref.argmax(-1))
        assert (rows - ref).abs().max() < 0.05 * ref.abs().max()
