"""Qwen3-Next (qwen3_next) and Qwen3.5 MoE (qwen3_5_moe_text, the same layers with four linear-layer input
projections): the gated delta rule (chunked = recurrent = transformers'), long prompts and prompts prefilled
in chunks against transformers, prompt caching off for their linear-attention states, the native decode
kernels against the torch path, the names and norms the converter maps, refusals. Their oracle, batch and tier
tests run with every family's (tests/hf_tiny.py FAMILIES: linear layers 0 and 2, a gated full-attention layer
1)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_greedy, hf_logits, load_hf, tiny_config_kwargs
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.layers.linear_attn import StateCache, delta_chunked, delta_step, l2norm
from colibri.models.base import build
from colibri.models.qwen3_next import check_config, prepare, sanitize

P = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
FAMILIES = ["qwen3_next", "qwen3_5_moe_text"]


def _inputs(n: int, H: int = 4, Dk: int = 16, Dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, H, Dk, generator=g), torch.randn(n, H, Dk, generator=g)
    v = torch.randn(n, H, Dv, generator=g)
    decay, beta = -torch.rand(n, H, generator=g), torch.rand(n, H, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_chunked_delta_rule_is_transformers_and_the_recurrence(n: int) -> None:
    q, k, v, g, beta = _inputs(n)
    qn, kn = l2norm(q) * 16**-0.5, l2norm(k)
    S = torch.zeros(4, 16, 8)
    out = delta_chunked(qn, kn, v, g, beta, S)
    ref, ref_S = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref[0]) and torch.equal(S, ref_S[0])
    # the recurrence, from a state that is not zero, agrees with the chunked form to rounding
    S0 = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
    S1, S2 = S0.clone(), S0.clone()
    steps = torch.stack([delta_step(qn[t], kn[t], v[t], g[t], beta[t], S1) for t in range(n)])
    torch.testing.assert_close(delta_chunked(qn, kn, v, g, beta, S2), steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S2, S1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_long_and_chunk_prefilled_prompts_match_transformers(ckpt, model_type) -> None:
    hf = load_hf(ckpt.hf(model_type))
    ids = P * 13  # 156 tokens: three chunks of the delta rule
    path = ckpt.coli(model_type, "f32")
    with colibri.load(path, ctx_size=256, threads=2) as llm:
        assert (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item() < 5e-4
    ref = hf_greedy(hf, ids, 12)
    # prompts fed 48 rows a step: each chunk continues the state the last one left (conv inputs included)
    with colibri.load(path, ctx_size=256, threads=2, prefill_chunk=48) as llm:
        assert list(llm.generate_ids(ids, 12, temperature=0, ignore_eos=True)) == ref


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prompt_caching_stays_off_and_saved_caches_are_refused(ckpt, tmp_path, model_type) -> None:
    hf = load_hf(ckpt.hf(model_type))
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=96, threads=2, slots=1) as llm:
        assert not llm.slots.rewindable
        for prompt in (P, P + [33, 71, 8], P):
            h = llm.submit(prompt, 8, ignore_eos=True)
            assert h.wait() == hf_greedy(hf, prompt, 8) and h.stats.cached_tokens == 0
        with pytest.raises(ColibriError, match="linear-attention"):
            llm.save_prompt_cache(tmp_path / "slot.bin")


def test_a_state_is_not_rewound() -> None:
    c = StateCache(8, 4, 2, 4, 4, torch.float32)
    c.ssm.fill_(1.0)
    c.pos = 10
    c.resume(10)  # continuing where it stands
    with pytest.raises(ColibriError, match="cannot continue from position 7"):
        c.resume(7)
    c.resume(0)  # a new sequence starts afresh
    assert c.pos == 0 and not c.ssm.any()


def test_names_and_zero_centred_norms() -> None:
    assert sanitize("model.layers.0.linear_attn.in_proj_qkvz.weight") == "model.layers.0.self_attn.in_proj_qkvz.weight"
    assert sanitize("mtp.layers.0.mlp.gate.weight") == "mtp.0.block.mlp.gate.weight"  # (the MTP layer: layers/mtp.py)
    assert sanitize("mtp.fc.weight") == "mtp.0.eh_proj.weight"
    assert sanitize("mtp.pre_fc_norm_hidden.weight") == "mtp.0.hnorm.weight"
    w = torch.tensor([0.5, -0.25], dtype=torch.bfloat16)
    for name in ("model.norm.weight", "model.layers.3.input_layernorm.weight",
                 "model.layers.3.self_attn.q_norm.weight", "mtp.0.enorm.weight", "mtp.0.norm.weight",
                 "mtp.0.block.post_attention_layernorm.weight"):
        assert torch.equal(prepare(name, w, {}), torch.tensor([1.5, 0.75]))
    assert prepare("model.layers.0.self_attn.norm.weight", w, {}) is w  # (the gated norm is not zero-centred)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["linear_attention"] * 2}, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.0625}},
     "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    cfg = {"model_type": "qwen3_next", **tiny_config_kwargs("qwen3_next")}
    check_config(cfg)
    with pytest.raises(ColibriError, match=field):
        check_config(cfg | over)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_batches_give_each_sequence_its_own_tokens(ckpt, model_type, scheme) -> None:
    """bf16 compute with quantized weights: rows of several sequences in one step (each its own state) give
    the tokens each gets alone."""
    path = ckpt.coli(model_type, scheme)
    prompts = [P, P[:5] + [88, 9], [1, 250, 4, 4, 19]]
    with colibri.load(path, ctx_size=96, threads=2, slots=3) as llm:
        together = [h.wait() for h in [llm.submit(p, 10, ignore_eos=True) for p in prompts]]
        alone = [list(llm.generate_ids(p, 10, temperature=0, ignore_eos=True)) for p in prompts]
    assert together == alone and len({tuple(t) for t in alone}) == 3


def test_a_slot_costs_its_attention_positions_plus_fixed_states() -> None:
    """What the planner and the --ctx-size check count (CausalLM.cache_cost)."""
    model, _ = build("qwen3_next", {"model_type": "qwen3_next", **tiny_config_kwargs("qwen3_next")})
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == 2 * 2 * 16 * 2  # the full-attention layer's K and V: 2 kv heads of 16, bf16
    conv_dim = 2 * 2 * 16 + 4 * 16  # q, k (2 key heads of 16), v (4 value heads of 16)
    assert fixed == 2 * (conv_dim * 3 * 2 + 4 * 16 * 16 * 4)  # two linear layers: conv inputs (bf16), f32 states


def _both_ways(ckpt, model_type: str, scheme: str, monkeypatch, path: str, kernel: str) -> dict[bool, list]:
    """Three bf16 requests batched, with the mixer's native `path` ("rows": the kernels at all, "block": the whole
    block in one call) taken and declined: per request its tokens and each token's (log-prob, top 3); the
    native_delta `kernel` must run exactly when the path is taken."""
    from colibri.layers import linear_attn

    mixer = linear_attn.GatedDeltaNet
    calls: list[int] = []
    real = getattr(linear_attn.native_delta, kernel)
    prompts = [P, P[:5] + [88, 9], [1, 250, 4, 4, 19]]
    out = {}
    for on in (True, False):
        calls.clear()
        with monkeypatch.context() as mp:
            mp.setattr(linear_attn.native_delta, kernel, lambda *a: calls.append(1) or real(*a))
            if path == "rows":  # (the fused block calls the same rows from C: off on both sides)
                mp.setattr(mixer, "fused", lambda self, *a: None)
                if not on:
                    mp.setattr(mixer, "_native_rows", lambda self, x, kv: False)
            elif not on:
                mp.setattr(mixer, "fused", lambda self, *a: None)
            with colibri.load(ckpt.coli(model_type, scheme), ctx_size=96, threads=2, slots=3) as llm:
                events: list[list] = [[] for _ in prompts]
                hs = [llm.submit(p, 12, ignore_eos=True, logprobs=3, listener=ev.append)
                      for p, ev in zip(prompts, events)]
                out[on] = [(h.wait(), [(e.logprob, e.top) for e in ev if e is not None]) for h, ev in zip(hs, events)]
        assert bool(calls) == on
    return out


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_native_decode_rows_agree_with_the_torch_path(ckpt, model_type, scheme, monkeypatch) -> None:
    """kernels/delta.c (bf16 decode rows of several sequences) against the torch path: the same arithmetic in
    another summation order, so the same tokens and log-probs to bf16 rounding."""

    out = _both_ways(ckpt, model_type, scheme, monkeypatch, "rows", "delta_rows")
    for (a, la), (b, lb) in zip(out[True], out[False]):
        assert a == b
        torch.testing.assert_close(torch.tensor([lp for lp, _ in la]), torch.tensor([lp for lp, _ in lb]),
                                   atol=0.05, rtol=0)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_fused_block_gives_the_layer_by_layer_bits(ckpt, model_type, scheme, monkeypatch) -> None:
    """coli_delta_block (norm, both input projections, delta rows, out_proj, residual, post norm in one call)
    against the same kernels called one by one from Python: the same tokens and log-probs, bit for bit."""
    out = _both_ways(ckpt, model_type, scheme, monkeypatch, "block", "delta_block")
    assert out[True] == out[False]


def test_the_cli_refuses_a_prompt_cache_file_before_generating(ckpt, tmp_path, capsys) -> None:
    from colibri.cli.run import main

    cache = tmp_path / "p.cache"
    with pytest.raises(ColibriError, match="drop --prompt-cache"):
        main(["--model", str(ckpt.coli("qwen3_next", "f32")), "--prompt", "Once upon a time", "-n", "4",
              "--prompt-cache", str(cache), "--ctx-size", "64"])
    assert capsys.readouterr().out == "" and not cache.exists()  # nothing generated, nothing written
