"""DBRX (`dbrx`). The oracle, batch, tier, prompt-cache and native-accuracy tests run it with every family
(tests/tiny_configs.py FAMILIES: its nested config, LayerNorms without a bias, fused and clamped q/k/v, experts
fused as [E·I, H]; test_native_step.py its one-call step); here the converter's reading of its layout, its flat
config, the unnormalised router, the native blocks and the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import hf_logits, load_hf
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.engine.decode_plan import DecodePlan
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.layers.layers import is_rms
from colibri.models.dbrx import check_config, flat_config, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]

# dbrx-instruct's config.json as released (the nested sections' fields that matter)
RELEASED = {"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768,
            "vocab_size": 100352, "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000},
            "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4,
                           "moe_normalize_expert_weights": 1, "moe_jitter_eps": 0.01, "ffn_act_fn": {"name": "silu"}},
            "tie_word_embeddings": False}


def test_the_released_config_reads_flat() -> None:
    flat = flat_config(RELEASED)
    want = {"hidden_size": 6144, "num_attention_heads": 48, "num_hidden_layers": 40, "max_position_embeddings": 32768,
            "num_key_value_heads": 8, "rope_theta": 500000, "clip_qkv": 8, "intermediate_size": 10752,
            "num_local_experts": 16, "num_experts_per_tok": 4, "moe_normalize_expert_weights": 1, "hidden_act": "silu"}
    assert {k: flat[k] for k in want} == want
    assert "attn_config" not in flat and "ffn_config" not in flat
    check_config(flat)
    # (transformers 5 would read rope_parameters; the nested rope_theta is the released one)
    assert flat_config({**RELEASED, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})["rope_theta"] \
        == 500000


def test_the_converter_reads_wqkv_and_the_fused_experts(ckpt) -> None:
    """q/k/v are Wqkv's row blocks; expert e's gate/up are rows e·I..(e+1)·I of w1/v1, its down those of w2,
    transposed."""
    st = load_file(ckpt.hf("dbrx") / "model.safetensors")
    inter, hidden, kv = 32, 64, 2 * 16
    with Container(ckpt.coli("dbrx", "f32")) as c:
        wqkv = st["transformer.blocks.1.norm_attn_norm.attn.Wqkv.weight"]
        for part, rows in (("q", slice(0, hidden)), ("k", slice(hidden, hidden + kv)),
                           ("v", slice(hidden + kv, hidden + 2 * kv))):
            assert torch.equal(c.tensor(f"model.layers.1.self_attn.{part}_proj.weight"), wqkv[rows])
        rec = {sub: c.tensor(full) for sub, full in c.record("model.layers.1.mlp.experts.2")["tensors"].items()}
        rows = slice(2 * inter, 3 * inter)
        pre = "transformer.blocks.1.ffn.experts.mlp."
        assert torch.equal(rec["gate_up.weight"], torch.cat([st[pre + "w1"][rows], st[pre + "v1"][rows]]))
        assert torch.equal(rec["down.weight"], st[pre + "w2"][rows].t())
        assert c.meta["config"]["num_local_experts"] == 4 and "attn_config" not in c.meta["config"]


def test_unnormalised_routing_matches_transformers(ckpt) -> None:
    """moe_normalize_expert_weights null: the top-k softmax weights as they are."""
    over = {"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2,
                           "moe_normalize_expert_weights": None}}
    ref = hf_logits(load_hf(ckpt.hf("dbrx", **over)), PROMPT)
    with colibri.load(ckpt.coli("dbrx", "f32", **over), ctx_size=64, threads=2) as llm:
        assert not llm.model.model.layers[0].mlp.gate.norm_topk_prob
        got = llm.logits(PROMPT).float()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_the_native_blocks_take_dbrx_layers(ckpt) -> None:
    """int8 runs DBRX's layers in the kernels: the attention block with its bias-less LayerNorms and the clamp, the
    one-call step's tail with the final LayerNorm (test_native_step.py: the same bits as the kernels one by one)."""
    from colibri.engine import native_step

    with colibri.load(ckpt.coli("dbrx", "int8"), ctx_size=64, threads=2) as llm:
        m = llm.model
        for b in m.model.layers:
            assert not is_rms(b.input_layernorm) and not b.input_layernorm.bias.any()
            assert b.self_attn.a.scores.clip_qkv == 2.0
            assert b.self_attn._native_layer(b.input_layernorm, b.post_attention_layernorm) is not None
            assert b.mlp.gate.native_routing() is not None
        assert native_step.tail(m) is not None and DecodePlan(m).native_layers() is not None


def test_names() -> None:
    block, layer = "transformer.blocks.7.", "model.layers.7."
    assert sanitize("transformer.wte.weight") == "model.embed_tokens.weight"
    assert sanitize("transformer.norm_f.weight") == "model.norm.weight"
    for hf, ours in (("norm_attn_norm.norm_2.weight", "post_attention_layernorm.weight"),
                     ("norm_attn_norm.attn.k_proj.weight", "self_attn.k_proj.weight"),
                     ("norm_attn_norm.attn.out_proj.weight", "self_attn.o_proj.weight"),
                     ("ffn.router.layer.weight", "mlp.gate.weight"), ("ffn.experts.mlp.w2", "mlp.experts.down_proj")):
        assert sanitize(block + hf) == layer + ours


@pytest.mark.parametrize("change, want", [
    ({"ffn_config": {**RELEASED["ffn_config"], "moe_normalize_expert_weights": 2}}, "1 \\(as released\\) or null"),
    ({"ffn_config": {**RELEASED["ffn_config"], "ffn_act_fn": {"name": "gelu"}}}, "only silu"),
    ({"attn_config": {**RELEASED["attn_config"], "clip_qkv": -1}}, "a number > 0 or null"),
    ({"tie_word_embeddings": True}, "its own tensor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "only default"),
    ({"attn_config": [1, 2]}, "attn_config must be an object"),
])
def test_refusals(change: dict, want: str) -> None:
    with pytest.raises(ColibriError, match=want):
        check_config(flat_config({**RELEASED, **change}))


def test_a_damaged_checkpoint_is_one_error(ckpt, tmp_path) -> None:
    """A Wqkv with too few rows for the config, or a fused expert tensor that does not split into the experts: one
    line at conversion, no traceback."""
    for name, rows in (("transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight", 100),
                       ("transformer.blocks.0.ffn.experts.mlp.w1", 126)):
        src = tmp_path / name
        shutil.copytree(ckpt.hf("dbrx"), src)
        st = load_file(src / "model.safetensors")
        st[name] = st[name][:rows].clone()
        save_file(st, str(src / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ColibriError, match="transformer.blocks.0"):
            convert(src, tmp_path / "m.coli", "f32", 32, progress=False)
    cfg = json.loads((ckpt.hf("dbrx") / "config.json").read_text())
    assert cfg["attn_config"]["clip_qkv"] == 2.0  # (the tiny model clamps: tests/tiny_configs.py)
