"""DeepSeek-V3.2 (deepseek_v32): the dense-layer rule as transformers', the native MLA block (which the dense
stretch of a sequence takes) writing the indexer's keys as the torch layer does, the block past index_topk over the
selected latents (V3.2, GLM-5, A.X K2) against the torch layer, refusals. Its oracle, batch,
prompt-cache and tier tests run with every family's (tests/hf_tiny.py FAMILIES: the indexer keeps 8 positions,
so their runs attend sparsely)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from transformers import DeepseekV32Config

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.deepseek_v32 import ModelArgs, check_config

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


@pytest.mark.parametrize("over", [{"first_k_dense_replace": 3, "num_hidden_layers": 5},
                                  {"first_k_dense_replace": 9, "num_hidden_layers": 4}, {}])
def test_dense_layers_follow_transformers(over) -> None:
    cfg = {**tiny_config_kwargs("deepseek_v32"), **over}
    ref = DeepseekV32Config(**cfg).mlp_layer_types
    a = ModelArgs.from_dict({"model_type": "deepseek_v32", **cfg})
    assert [a.is_moe(i) for i in range(len(ref))] == [t == "sparse" for t in ref]


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_the_native_block_writes_the_indexers_keys(ckpt, monkeypatch) -> None:
    """bf16 int8, a context within index_topk (every position kept): the native MLA block's run gives the torch
    layer's tokens, and writes every position's indexer key -- layer 0's (whose input both runs share) bit for
    bit the torch layer's; the one-call step stays off (it would skip the keys)."""
    from colibri.layers import mla

    over = {"q_lora_rank": 32, "kv_lora_rank": 32, "index_topk": 64}
    out = {}
    real = mla.MLAttention.fused
    calls: list[bool] = []

    def spy(self, *a):
        calls.append(True)
        return real(self, *a)

    for fused in (True, False):
        calls.clear()
        monkeypatch.setattr(mla.MLAttention, "fused", spy if fused else (lambda self, *a: None))
        monkeypatch.setattr(native, "decode_layers", lambda *a, **k: pytest.fail("one-call step"))
        with colibri.load(ckpt.coli("deepseek_v32", "int8", **over), ctx_size=96, threads=2, slots=1) as llm:
            toks = list(llm.generate_ids(PROMPT, 10, temperature=0, ignore_eos=True))
            keys = [c.ik[: len(PROMPT) + 9].clone() for c in llm.slots.caches[0]]
        out[fused] = toks, keys
        assert bool(calls) == fused
    assert out[True][0] == out[False][0]
    assert torch.equal(out[True][1][0], out[False][1][0])
    assert all(bool((k.abs().sum(-1) > 0).all()) for k in out[True][1])  # every layer, every position


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_a_context_within_index_topk_is_v3s_dense_attention_in_one_call(ckpt, monkeypatch) -> None:
    """ctx_size <= index_topk: no indexer keys cached, the one-call step runs, and the tokens are the per-layer
    native path's (a longer context, same positions: every one kept there too)."""
    from colibri.engine import native_step

    over = {"q_lora_rank": 32, "kv_lora_rank": 32, "index_topk": 64}
    one_call: list[bool] = []

    def spy(real):
        def call(*a, **k):
            out = real(*a, **k)
            if out is not None:
                one_call.append(True)
            return out
        return call

    for name in ("step", "steps", "layers"):  # (the whole step, native runs of steps, the blocks alone)
        monkeypatch.setattr(native_step, name, spy(getattr(native_step, name)))
    with colibri.load(ckpt.coli("deepseek_v32", "int8", **over), ctx_size=64, threads=2, slots=1) as llm:
        assert not any(hasattr(c, "ik") for c in llm.slots.caches[0])
        short = list(llm.generate_ids(PROMPT, 12, temperature=0, ignore_eos=True))
    assert one_call
    one_call.clear()
    with colibri.load(ckpt.coli("deepseek_v32", "int8", **over), ctx_size=96, threads=2, slots=1) as llm:
        long = list(llm.generate_ids(PROMPT, 12, temperature=0, ignore_eos=True))
    assert not one_call and long == short


@pytest.mark.parametrize("over,field", [
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_topk": 0}, "index_topk"),
    ({"index_head_dim": 4}, "index_head_dim"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"scoring_func": "softmax"}, "scoring_func")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    cfg = {"model_type": "deepseek_v32", **tiny_config_kwargs("deepseek_v32")}
    check_config(cfg)
    with pytest.raises(ColibriError, match=field):
        check_config(cfg | over)


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_both_mla_forms_select_as_transformers(ckpt, mode) -> None:
    """f32, the tiny model's index_topk of 8: prompts and decode steps through either MLA form (the absorbed one
    masks its latent scores with the selection) give transformers' logits and tokens."""
    from hf_tiny import hf_greedy_with_logits, hf_logits, load_hf

    hf = load_hf(ckpt.hf("deepseek_v32"))
    with colibri.load(ckpt.coli("deepseek_v32", "f32"), ctx_size=96, threads=2) as llm:
        for b in llm.model.model.layers:
            b.self_attn.mode = mode
        ids = PROMPT * 3
        assert (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
        ref, _ = hf_greedy_with_logits(hf, PROMPT, 30)
        assert list(llm.generate_ids(PROMPT, 30, temperature=0, ignore_eos=True)) == ref


def test_a_slot_counts_the_indexer_keys_long_contexts_cache() -> None:
    """What the planner and the --ctx-size check count (CausalLM.cache_cost, measured at a long context on the
    meta device): per position, each layer's latent and rope key and its indexer key."""
    from colibri.models.base import build

    model, _ = build("deepseek_v32", {"model_type": "deepseek_v32", **tiny_config_kwargs("deepseek_v32")})
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == 3 * (16 + 8 + 16) * 2 and fixed == 0  # 3 layers x (latent 16 + rope 8 + index key 16) bf16
    assert not any(b.self_attn.dense for b in model.model.layers)  # (the measurement left their mode alone)


@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.parametrize("family,scheme", [("deepseek_v32", "int8"), ("deepseek_v32", "int4"), ("axk2", "int8")])
def test_past_index_topk_each_layer_in_the_block_is_the_torch_layer(ckpt, family: str, scheme: str) -> None:
    """Past index_topk positions, a layer's rows (a decode row, a 3-row chunk) in kernels/mla.c's block over the
    selected positions' latents (gathered) against the torch layer from the same cache: the same selection, the
    outputs to bf16 rounding; with every position attended instead the rows differ far more (so the comparison sees
    the selection)."""
    import copy

    from test_native_step import prompt_then_decode

    from colibri.layers.batch import LayerKV

    over = {"q_lora_rank": 32, "kv_lora_rank": 32} if scheme == "int4" else {}
    g = torch.Generator().manual_seed(0)
    with colibri.load(ckpt.coli(family, scheme, **over), ctx_size=64, threads=2) as llm:
        prompt_then_decode(llm, PROMPT + [9, 21, 40])  # (15 positions cached: past index_topk, 8)
        S = len(PROMPT) + 3
        for b, cache in zip(llm.model.model.layers, llm.slots.caches[0]):
            m, args = b.self_attn, (b.input_layernorm, b.post_attention_layernorm)
            for T in (1, 3):
                h = (torch.randn(T, 64, generator=g) * 2).to(torch.bfloat16)
                c1, c2, c3 = (copy.deepcopy(cache) for _ in range(3))
                h_got, x_got = m._fused_sparse(h, LayerKV([(0, T, S, c1)], S), *args)
                h_ref = h + m(b.input_layernorm(h), LayerKV([(0, T, S, c2)], S))
                x_ref = b.post_attention_layernorm(h_ref)
                # every position attended (no selection): what the selection leaves out comes back
                h_all, _ = m._native_rows(m._native_layer(*args), h, [(0, T, S, c3)], S, [None] * T)
                for got, ref in ((h_got, h_ref), (x_got, x_ref)):
                    err = (got.float() - ref.float()).abs().max()
                    assert err <= 0.02 * ref.float().abs().max()
                assert (h_all.float() - h_ref.float()).abs().max() > 4 * (h_got.float() - h_ref.float()).abs().max()


@pytest.mark.skipif(not native.available(), reason="native kernels")
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "axk2"])
def test_past_index_topk_decode_takes_the_block(ckpt, monkeypatch, family: str) -> None:
    """int8, every position a one-row step: past index_topk each layer takes the block with the selection (GLM-5's
    shared layers with their carrier's), the top tokens those of the torch layers wherever rounding cannot flip
    them."""
    from hf_tiny import top2_margins
    from test_native_step import prompt_then_decode

    from colibri.models import deepseek_v32 as v32

    prompt = PROMPT + [9, 21, 40, 77]
    taken: list[bool] = []
    real = v32.DSAttention._fused_sparse

    def spy(*a):
        out = real(*a)
        taken.append(out is not None)
        return out

    with colibri.load(ckpt.coli(family, "int8"), ctx_size=64, threads=2) as llm:
        with monkeypatch.context() as mp:
            mp.setattr(v32.DSAttention, "_fused_sparse", spy)
            got = prompt_then_decode(llm, prompt, first=1)
        with monkeypatch.context() as mp:
            mp.setattr(v32.DSAttention, "_fused_sparse", lambda *a: None)
            ref = prompt_then_decode(llm, prompt, first=1)
        n_layers = len(llm.model.model.layers)
    assert taken == [True] * n_layers * (len(prompt) - 8)  # (positions 9.. hold more than index_topk, 8)
    diff = (got - ref).abs().max(-1).values
    sure = top2_margins(ref) > 2 * diff
    assert sure.sum() >= len(prompt) // 2 and torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])
