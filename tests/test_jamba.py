"""Jamba (jamba): the variants the tiny model does not take (attention first and experts in every layer, biased
projections without a conv bias, an explicit dt rank, a wider state) against transformers' logits and greedy tokens; a
slot's bytes; the release's names; refusals (chunked prompts, batches and prompt caching off:
tests/test_state_models.py). Its oracle, batch, tier and kernel-accuracy tests run with every
family's (tests/tiny_configs.py: Mamba + dense, Mamba + experts, attention + dense, Mamba + experts)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.base import build
from colibri.models.jamba import check_config, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "jamba", **tiny_config_kwargs("jamba"), **over}


@pytest.mark.parametrize("over", [
    {"attn_layer_offset": 0, "expert_layer_period": 1, "expert_layer_offset": 0},
    {"mamba_conv_bias": False, "mamba_proj_bias": True, "mamba_dt_rank": 6, "mamba_d_state": 12, "mamba_d_conv": 3}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    # (experts in every layer: logits up to ~96, so f32's rounding alone reaches 1e-4 where the machine's BLAS
    # sums in another order -- 1.2e-4 measured on an Intel Xeon, ~16 ulps of 96; the greedy tokens stay equal)
    matches_transformers(ckpt, "jamba", over, PROMPT, bound=2e-4)


def test_a_slot_counts_its_mamba_states() -> None:
    """K/V per position for the attention layer, a fixed state for each Mamba layer (CausalLM.cache_cost)."""
    model, _ = build("jamba", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == 2 * 2 * 16 * 2  # the attention layer's K and V: 2 kv heads of 16, bf16
    assert fixed == 3 * (128 * 3 * 2 + 128 * 8 * 4)  # three Mamba layers: conv inputs (bf16), f32 states [I, N]


def test_release_names_map_to_the_canonical_ones() -> None:
    pairs = {"model.layers.0.mamba.in_proj.weight": "model.layers.0.self_attn.in_proj.weight",
             "model.layers.0.mamba.dt_layernorm.weight": "model.layers.0.self_attn.dt_layernorm.weight",
             "model.layers.0.mamba.A_log": "model.layers.0.self_attn.A_log",
             "model.layers.0.feed_forward.gate_proj.weight": "model.layers.0.mlp.gate_proj.weight",
             "model.layers.1.feed_forward.router.weight": "model.layers.1.mlp.gate.weight",
             "model.layers.1.feed_forward.experts.3.down_proj.weight": "model.layers.1.mlp.experts.3.down_proj.weight",
             "model.layers.1.pre_ff_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
             "model.layers.4.self_attn.q_proj.weight": "model.layers.4.self_attn.q_proj.weight",
             "model.final_layernorm.weight": "model.norm.weight"}
    assert {k: sanitize(k) for k in pairs} == pairs


@pytest.mark.parametrize("over,field", [
    ({"attn_layer_offset": 4}, "attn_layer_offset"),
    ({"expert_layer_offset": 2}, "expert_layer_offset"),
    ({"attn_layer_period": 0}, "attn_layer_period"),
    ({"num_experts": 1}, "num_experts"),
    ({"expert_layer_period": 8, "expert_layer_offset": 5}, "num_experts"),  # (no layer of experts in 4)
    ({"mamba_dt_rank": 0}, "mamba_dt_rank"),
    ({"mamba_d_conv": 1}, "mamba_d_conv"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme,over", [("int8", {}), ("int4", {}), ("int8", {"mamba_conv_bias": False,
                                                                              "mamba_d_state": 20})])
def test_decode_rows_in_the_kernels_agree_with_the_torch_path(ckpt, monkeypatch, scheme: str, over: dict) -> None:
    """kernels/mamba1.c on bf16 decode rows, step after step, three ways: the whole block (coli_mamba1_block), the
    mixer from in_proj's output (coli_mamba1_rows: the same bits), and the convolution and scan step alone with
    the modules between (where x_proj or dt_proj is not a native QLinear); each agrees with the torch form to bf16
    rounding and picks the same tokens, and every Mamba layer of every decode step took the call asked for."""
    from colibri.kernels import native_mamba
    from colibri.layers import mamba1

    def logits(llm, mode: str) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            if mode == "torch":
                mp.setattr(mamba1.Mamba1Mixer, "_native_rows", lambda self, x, kv: False)
            if mode == "calls":
                mp.setattr(mamba1, "_native_linear", lambda p: False)
                mp.setattr(mamba1.native_mamba, "mamba1_scan", _spy(native_mamba.mamba1_scan, taken))
            elif mode == "rows":
                mp.setattr(mamba1.Mamba1Mixer, "fused", lambda self, *a: None)
                mp.setattr(mamba1.native_mamba, "mamba1_rows", _spy(native_mamba.mamba1_rows, taken))
            else:
                mp.setattr(mamba1.Mamba1Mixer, "fused", _spy(mamba1.Mamba1Mixer.fused, taken))
            logits = prompt_then_decode(llm, PROMPT)
        n, steps = sum(isinstance(b.self_attn, mamba1.Mamba1Mixer) for b in llm.model.model.layers), len(PROMPT) - 4
        if mode in ("calls", "rows"):
            assert len(taken) == n * steps
        elif mode == "block":  # (the prompt's rows take torch: the spy sees its layers decline)
            assert taken == [False] * n + [True] * n * steps
        return logits

    with colibri.load(ckpt.coli("jamba", scheme, **over), ctx_size=64, threads=2) as llm:
        ref, rows = logits(llm, "torch"), logits(llm, "rows")
        assert torch.equal(rows, logits(llm, "block"))
        for got in (rows, logits(llm, "calls")):
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("T,N", [(1, 16), (3, 5), (2, 64)])
def test_the_scan_step_is_the_recurrence(T: int, N: int) -> None:
    """coli_mamba1_scan against the recurrence in f32 torch: each row's state to f32 rounding (its exp within a few
    ulp of torch's, over decays from ~1 to ~exp(-80)), its output to one bf16 rounding."""
    from colibri.kernels import native_mamba

    g = torch.Generator().manual_seed(T * 100 + N)
    inner = 48
    bf = torch.bfloat16
    dt = (torch.randn(T, inner, generator=g) * 2).to(bf)  # (softplus of it: ~0.01 to ~7)
    B, C, u = (torch.randn(T, d, generator=g).to(bf) for d in (N, N, inner))
    xz = torch.randn(T, 2 * inner, generator=g).to(bf)
    A = -torch.rand(inner, N, generator=g) * 12 - 0.01
    D = torch.randn(inner, generator=g)
    S0 = [torch.randn(inner, N, 1, generator=g) for _ in range(T)]
    S = [s.clone() for s in S0]
    y = native_mamba.mamba1_scan(dt, B, C, u, xz, [s.data_ptr() for s in S], A, D)
    for t in range(T):
        d = torch.nn.functional.softplus(dt[t].float())[:, None]  # [I, 1]
        want = S0[t][..., 0] * (d * A).exp() + d * B[t].float() * u[t].float()[:, None]
        torch.testing.assert_close(S[t][..., 0], want, rtol=2e-6, atol=1e-6)
        out = (want @ C[t].float() + u[t].float() * D) * torch.nn.functional.silu(xz[t, inner:].float())
        torch.testing.assert_close(y[t].float(), out, rtol=8e-3, atol=1e-5)


def test_experts_are_read_ahead_past_the_dense_layers_between(ckpt) -> None:
    """Jamba's MoE layers alternate with dense ones: layer 1's residual predicts layer 3's experts (the next MoE
    layer's router, store/lookahead.py), predictions the cache scores against layer 3's fetches (and reads ahead
    where its reader has idle places: timing, so not asserted); the tokens stay those of the all-RAM run."""
    from test_tiers import configs

    from colibri.api import Engine
    from colibri.store.lookahead import LookAhead

    path = ckpt.coli("jamba", "f32")
    with Engine(path, ctx_size=64, threads=2) as llm:
        want = list(llm.generate_ids(PROMPT, 12, temperature=0, ignore_eos=True))
    with Engine(path, ctx_size=64, threads=2, **configs(path)["disk-unbudgeted"]) as llm:
        assert {L: nxt[0] for L, nxt in LookAhead(llm.store.source, llm.model.model.layers).next.items()} == {1: 3}
        assert list(llm.generate_ids(PROMPT, 12, temperature=0, ignore_eos=True)) == want
        s = llm.store_stats()
    assert s["pred_total"] >= 11 * 2 and s["misses"] > 0  # (layer 3's top-2, for every decode step at least)
