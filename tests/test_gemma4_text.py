"""Gemma 4 MoE (gemma4_text): transformers' defaults where a config leaves them out; the variants the tiny model does
not take (a tied head, v_proj on the full layers, the older global_head_dim form, the default RoPE per type, no
soft-cap) against transformers' logits and greedy tokens; the multimodal release's layout; the embedding factor's
rounding; refusals by name. Its oracle, batch, prompt-cache and tier tests run with every family's
(tests/tiny_configs.py: a sliding layer, full layers with their own head width and KV heads and keys as values,
proportional RoPE, a dense MLP beside the experts, soft-capped logits)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import edited_copy, hf_greedy_with_logits, hf_logits, load_hf, tiny_config_kwargs
from test_native_step import _spy
from transformers import Gemma4TextConfig

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.base import build
from colibri.models.gemma4_text import ModelArgs, check_config, prepare, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "gemma4_text", **tiny_config_kwargs("gemma4_text"), **over}


def _same_as_transformers(hf_folder, coli) -> None:
    hf = load_hf(hf_folder)
    ref = hf_logits(hf, PROMPT * 3)  # 36 positions: past the sliding window of 8
    with colibri.load(coli, ctx_size=64, threads=2) as llm:
        assert (llm.logits(PROMPT * 3).float() - ref).abs().max() < 1e-4
        want, _ = hf_greedy_with_logits(hf, PROMPT, 8)
        assert list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True)) == want


def test_defaults_are_transformers() -> None:
    kw = {k: v for k, v in tiny_config_kwargs("gemma4_text").items()
          if k not in ("layer_types", "per_layer_config", "rope_parameters")}
    for over in ({"num_hidden_layers": 8}, {"num_hidden_layers": 8, "global_head_dim": 64,
                                            "num_global_key_value_heads": 1}):
        ref = Gemma4TextConfig(**(kw | over))
        a = ModelArgs.from_dict({**kw, **over})
        assert a.layer_types == ref.layer_types  # five sliding, one full; the last one full
        assert [a.layer(i) for i in range(8)] \
            == [(ref.per_layer_config[i].head_dim, ref.per_layer_config[i].num_key_value_heads) for i in range(8)]
        for kind in ref.rope_parameters:
            assert a.rope(kind) == ref.rope_parameters[kind]
    model, _ = build("gemma4_text", _cfg())  # the tiny config: per-layer heads, no v_proj where keys are values
    attn = [b.self_attn for b in model.model.layers]
    assert [(m.a.head_dim, m.a.kv_heads, hasattr(m, "v_proj")) for m in attn] == [(16, 2, True), (32, 1, False),
                                                                                   (32, 1, False)]
    assert [int((m.rope.inv_freq != 0).sum()) for m in attn] == [8, 4, 4]  # proportional: a quarter of 16 rotates


@pytest.mark.parametrize("over", [
    {"tie_word_embeddings": True},  # (as released)
    {"attention_k_eq_v": False},  # (v_proj on the full layers too)
    {"rope_parameters": None, "final_logit_softcapping": None}])  # (transformers' default RoPE per type)
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    _same_as_transformers(ckpt.hf("gemma4_text", **over), ckpt.coli("gemma4_text", "f32", **over))


def test_a_config_with_global_head_dim_converts_as_transformers_reads_it(ckpt, tmp_path) -> None:
    # Configs saved before per_layer_config name the full layers' head width and KV heads globally.
    src = edited_copy(ckpt.hf("gemma4_text"), tmp_path / "hf", drop=("per_layer_config",), global_head_dim=32,
                      num_global_key_value_heads=1)
    _same_as_transformers(src, convert(src, tmp_path / "m.coli", "f32", progress=False))


def test_the_multimodal_release_converts_to_its_text_model(ckpt, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    src = edited_copy(ckpt.hf("gemma4_text"), tmp_path / "hf")
    weights = load_file(src / "model.safetensors")
    moved = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
             for k, v in weights.items()}
    towers = {"model.vision_tower.encoder.layers.0.mlp.fc1.weight": torch.zeros(8, 4),
              "model.embed_vision.embedding_projection.weight": torch.zeros(64, 8),
              "model.audio_tower.layers.0.weight": torch.zeros(4)}
    save_file(moved | towers, str(src / "model.safetensors"))
    text = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                                 "tie_word_embeddings": False}))
    out = convert(src, tmp_path / "m.coli", "f32", progress=False)
    with colibri.load(out, ctx_size=64, threads=2) as a, \
            colibri.load(ckpt.coli("gemma4_text", "f32"), ctx_size=64, threads=2) as b:
        assert torch.equal(a.logits(PROMPT), b.logits(PROMPT))


def test_release_names_map_to_the_canonical_ones() -> None:
    pairs = {"model.language_model.layers.2.router.proj.weight": "model.layers.2.mlp.gate.weight",
             "model.layers.2.router.per_expert_scale": "model.layers.2.mlp.gate.per_expert_scale",
             "model.layers.2.experts.gate_up_proj": "model.layers.2.mlp.experts.gate_up_proj",
             "model.layers.2.mlp.up_proj.weight": "model.layers.2.mlp.dense.up_proj.weight",
             "model.layers.2.post_attention_layernorm.weight": "model.layers.2.self_attn.out_norm.weight",
             "model.layers.2.pre_feedforward_layernorm_2.weight": "model.layers.2.mlp.experts_in_norm.weight",
             "model.layers.2.post_feedforward_layernorm.weight": "model.layers.2.mlp.out_norm.weight",
             "model.layers.2.layer_scalar": "model.layers.2.layer_scalar",
             "model.language_model.embed_tokens.weight": "model.embed_tokens.weight"}
    assert {k: sanitize(k) for k in pairs} == pairs
    assert sanitize("model.vision_tower.encoder.layers.0.mlp.fc1.weight") is None


def test_the_embedding_factor_is_rounded_as_the_checkpoint_stores_it() -> None:
    # transformers multiplies by sqrt(hidden) cast to the table's dtype: 55.5 for a bf16 table of width 3072
    t = torch.ones(2, 3) * 0.5
    got = prepare("model.embed_tokens.weight", t.bfloat16(), {"hidden_size": 3072})
    assert torch.equal(got, (t * 55.5).bfloat16())
    assert torch.allclose(prepare("model.embed_tokens.weight", t, {"hidden_size": 3072}), t * 3072**0.5)
    assert prepare("lm_head.weight", t, {"hidden_size": 3072}) is t  # (a tied head keeps the unscaled table)


@pytest.mark.parametrize("over,field", [
    ({"enable_moe_block": False}, "enable_moe_block"),
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input"),
    ({"hidden_size_per_layer_input": None}, "hidden_size_per_layer_input"),  # (transformers' default: 256)
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"attention_bias": True}, "attention_bias"),
    ({"top_k_experts": 9}, "top_k_experts"),
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention"),
    ({"per_layer_config": {"1": {"head_dim": 32, "sliding_window": 4}}}, "per_layer_config"),
    ({"per_layer_config": {"1": {"num_key_value_heads": 3}}}, "num_key_value_heads")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    cfg = _cfg(**over)
    if over.get("hidden_size_per_layer_input", 0) is None:
        del cfg["hidden_size_per_layer_input"]
    with pytest.raises(ColibriError, match=field):
        check_config(cfg)


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("over", [{}, {"attention_k_eq_v": False}])
def test_the_fused_attention_block_gives_the_layer_by_layer_bits(ckpt, monkeypatch, scheme: str, over: dict) -> None:
    """kernels/block.c with keys as values and the values' weightless norm: the bits of the same kernels called one
    by one, step after step, and every layer took it."""
    from colibri.layers.batch import StepBatch
    from colibri.models.gemma4_text import Gemma4Attention

    def logits(llm, fused: bool) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            mp.setattr(Gemma4Attention, "fused", _spy(Gemma4Attention.fused, taken) if fused else lambda self, *a: None)
            cache, rows = llm.slots.caches[0], []
            with torch.inference_mode():  # (one row a step: a prompt chunk's unfused attention is torch's own)
                for pos in range(len(PROMPT)):
                    rows.append(llm.plan.step(torch.tensor([PROMPT[pos]]), StepBatch.single(cache, pos, 1),
                                          torch.tensor([0])))
        assert not fused or (taken and all(taken))
        return torch.cat(rows)

    with colibri.load(ckpt.coli("gemma4_text", scheme, **over), ctx_size=64, threads=2) as llm:
        assert torch.equal(logits(llm, True), logits(llm, False))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_bf16_rows_route_in_the_kernels_by_the_torch_rule() -> None:
    # bf16 rows: the input normed and scaled in bf16 as transformers does, then the kernels' softmax rule (top k
    # renormalised) and the per-expert scale; the same as the torch rule on those very values.
    from colibri.models.gemma4_text import Router

    torch.manual_seed(3)
    r = Router(64, 16, 4, 1e-6)
    r.weight.copy_(torch.randn(16, 64) * 0.3)
    r.scale.copy_(torch.rand(64) + 0.5)
    r.per_expert_scale.copy_(torch.rand(16) + 0.5)
    x = torch.randn(40, 64).bfloat16()
    idx, w = r(x)
    h = (r.norm(x) * r.scale.to(x.dtype) * r.root).float()  # the kernel's input, as f32
    probs = torch.softmax(h @ r.weight.T, -1)
    ref_w, ref_idx = probs.topk(4, -1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * r.per_expert_scale[ref_idx]
    a, mine = idx.sort(-1)
    b, theirs = ref_idx.sort(-1)
    assert torch.equal(a, b)
    torch.testing.assert_close(w.gather(1, mine), ref_w.gather(1, theirs), rtol=1e-5, atol=1e-6)
    assert not torch.equal(w, r(x.float())[1])  # (f32 rows: the torch path, without the bf16 roundings)
