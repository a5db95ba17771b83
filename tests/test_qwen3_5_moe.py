"""Qwen3.5 MoE as released (`qwen3_5_moe`: the text model under `text_config` and `model.language_model.`, a vision
tower and MTP weights beside it) converts to its text model: the same logits as the text checkpoint. Its
layers are tested with Qwen3-Next's (tests/test_qwen3_next.py) and every family's (tests/hf_tiny.py FAMILIES)."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.format.container import Container
from colibri.models.qwen3_5_moe_text import ModelArgs, sanitize

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def test_the_multimodal_checkpoint_converts_to_its_text_model(ckpt, tmp_path) -> None:
    src = tmp_path / "mm"
    shutil.copytree(ckpt.hf("qwen3_5_moe_text"), src)
    text = json.loads((src / "config.json").read_text())
    base = load_file(src / "model.safetensors")
    renamed = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
               for k, v in base.items()}
    extra = {"model.visual.blocks.0.attn.qkv.weight": torch.randn(8, 4), "model.visual.merger.norm.weight":
             torch.ones(4), "mtp.fc.weight": torch.randn(4, 8)}
    (src / "model.safetensors").unlink()
    save_file(renamed | extra, str(src / "model.safetensors"))
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": {**text, "model_type": "qwen3_5_moe_text"}, "vision_config": {"depth": 1},
           "tie_word_embeddings": False}
    (src / "config.json").write_text(json.dumps(cfg))
    out = convert(src, tmp_path / "mm.coli", "f32", progress=False)
    with Container(out) as c:
        assert c.model_type == "qwen3_5_moe_text"
        assert sorted(c.meta["converter"]["dropped"]) == sorted(extra)
    ours = colibri.load(out, ctx_size=64, threads=2).logits(IDS)
    ref = colibri.load(ckpt.coli("qwen3_5_moe_text", "f32"), ctx_size=64, threads=2).logits(IDS)
    assert torch.equal(ours, ref)


def test_names_and_the_router_rule() -> None:
    assert sanitize("model.language_model.layers.2.linear_attn.in_proj_qkv.weight") == \
        "model.layers.2.self_attn.in_proj_qkv.weight"
    assert sanitize("model.visual.patch_embed.proj.weight") is None
    assert sanitize("mtp.norm.weight") == "mtp.0.norm.weight"  # (kept where the config counts it: layers/mtp.py)
    a = ModelArgs.from_dict({"hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 384,
                             "norm_topk_prob": False})
    assert a.norm_topk_prob and a.is_sparse(0) and a.is_sparse(1)  # (transformers' router always renormalises)
