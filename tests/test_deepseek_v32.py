"""DeepSeek-V3.2 (deepseek_v32): the dense-layer rule as transformers', the native MLA block (which the dense
stretch of a sequence takes) writing the indexer's keys as the torch layer does, refusals. Its oracle, batch,
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
    from colibri.models import mla

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
    from colibri.models import native_step

    over = {"q_lora_rank": 32, "kv_lora_rank": 32, "index_topk": 64}
    one_call: list[bool] = []

    def spy(real):
        def call(*a, **k):
            out = real(*a, **k)
            if out is not None:
                one_call.append(True)
            return out
        return call

    for name in ("run_step", "run_steps", "run"):  # (the whole step, native runs of steps, the blocks alone)
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
