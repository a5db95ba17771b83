"""Mistral Small 4 (mistral4): its router's groups and scale against transformers, transformers' default RoPE
when a config has none, the query scaling's limit for the native blocks, refusals. Its oracle, batch,
prompt-cache, tier and one-call tests run with every family's (tests/hf_tiny.py FAMILIES: YaRN, queries scaled
past position 16, the kernels' one-group router)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_greedy_with_logits, hf_logits, load_hf, tiny_config_kwargs
from transformers import Mistral4Config

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.mistral4 import ModelArgs, check_config, rope_defaults

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def test_grouped_scaled_router_matches_transformers(ckpt) -> None:
    """Two groups of four, the best kept (a group scores its two best), renormalised then times 1.5: the torch
    router (the kernels have no such rule)."""
    over = {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5}
    hf = load_hf(ckpt.hf("mistral4", **over))
    with colibri.load(ckpt.coli("mistral4", "f32", **over), ctx_size=96, threads=2) as llm:
        ids = PROMPT * 3
        assert (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
        ref, _ = hf_greedy_with_logits(hf, PROMPT, 24)
        assert list(llm.generate_ids(PROMPT, 24, temperature=0, ignore_eos=True)) == ref
        assert all(b.mlp.gate.native_routing() is None for b in llm.model.model.layers if hasattr(b.mlp, "gate"))


def test_a_config_without_rope_parameters_means_transformers_defaults() -> None:
    cfg = {k: v for k, v in tiny_config_kwargs("mistral4").items() if k != "rope_parameters"}
    ref = Mistral4Config(**cfg).rope_parameters
    ours = rope_defaults({**cfg, "max_position_embeddings": ref.get("max_position_embeddings")})
    assert {k: ours[k] for k in ref if k in ours} == {k: ref[k] for k in ref if k in ours}
    assert ModelArgs.from_dict({"model_type": "mistral4", **cfg}).scaling() == (0.1, 8192)


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_rows_past_the_scaling_limit_leave_the_native_blocks(ckpt) -> None:
    """Below original_max_position_embeddings (16 here) the query scale is 1 and the native MLA block runs; a row
    at or past it takes torch's layer, which scales (and so does the one-call step: it stops at pos_limit)."""
    from colibri.layers.batch import LayerKV

    with colibri.load(ckpt.coli("mistral4", "int8", q_lora_rank=32, kv_lora_rank=32), ctx_size=64, threads=2) as llm:
        block = llm.model.model.layers[0]
        attn, cache = block.self_attn, llm.slots.caches[0][0]
        assert attn.pos_limit() == 16
        h = torch.randn(1, llm.model.model.norm.weight.shape[0]).to(torch.bfloat16)
        taken = {pos: attn.fused(h, LayerKV([(0, 1, pos, cache)], pos), block.input_layernorm,
                                 block.post_attention_layernorm) is not None for pos in (3, 15, 16, 30)}
    assert taken == {3: True, 15: True, 16: False, 30: False}


@pytest.mark.parametrize("over,field", [
    ({"n_group": 3}, "n_group"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0,
                          "original_max_position_embeddings": 16, "llama_4_scaling_beta": "0.1"}},
     "llama_4_scaling_beta"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    cfg = {"model_type": "mistral4", **tiny_config_kwargs("mistral4")}
    check_config(cfg)
    with pytest.raises(ColibriError, match=field):
        check_config(cfg | over)
