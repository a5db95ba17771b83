"""Llama 4: the released (multimodal) checkpoint layout converts to the text model, transformers' layer rules
(RoPE / no RoPE, chunked attention, MoE interleave) come from its own config class, and what is not
implemented is refused by name. Its oracle, batch, prompt-cache and tier tests run with every family's
(tests/hf_tiny.py FAMILIES): the tiny config there crosses chunk boundaries and moves the temperature tuning."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Llama4TextConfig

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.base import text_model_config
from colibri.models.llama4_text import ModelArgs, check_config
from tests.hf_tiny import tiny_config_kwargs

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3] * 3


def _cfg(**over) -> dict:
    return {"model_type": "llama4_text", **tiny_config_kwargs("llama4_text"), **over}


@pytest.mark.parametrize("over", [{}, {"num_hidden_layers": 8}, {"interleave_moe_layer_step": 1},
                                  {"no_rope_layer_interval": 2}, {"moe_layers": [0, 2]}])
def test_layer_rules_follow_transformers(over: dict) -> None:
    cfg = _cfg(**over)
    ref = Llama4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    for a in (ModelArgs.from_dict(cfg), ModelArgs.from_dict(ref.to_dict())):  # (a saved config lists them)
        assert a.no_rope_layers == ref.no_rope_layers and a.moe_layers == ref.moe_layers
        assert a.layer_types == ref.layer_types


@pytest.mark.parametrize("over,field", [({"num_experts_per_tok": 2}, "num_experts_per_tok"),
                                        ({"hidden_act": "gelu"}, "hidden_act"),
                                        ({"layer_types": ["full_attention"]}, "layer_types"),
                                        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
                                        ({"moe_layers": [9]}, "moe_layers")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_multimodal_checkpoint_converts_to_its_text_model(ckpt, tmp_path) -> None:
    """A released Llama 4 folder (model_type llama4, the text model's config under text_config, its tensors
    under language_model., a vision tower beside them) gives the text model's own container: the same
    logits as the text-only checkpoint."""
    src = ckpt.hf("llama4_text", fused=True)
    mm = tmp_path / "mm"
    shutil.copytree(src, mm)
    text = json.loads((src / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": text,
                                                "vision_config": {"hidden_size": 8}, "image_token_index": 9}))
    tensors = {f"language_model.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors |= {"vision_model.patch_embedding.weight": torch.randn(8, 4),
                "multi_modal_projector.linear_1.weight": torch.randn(8, 8)}
    (mm / "model.safetensors").unlink()
    save_file(tensors, str(mm / "model.safetensors"))
    a = colibri.load(convert(mm, tmp_path / "mm.coli", "f32", progress=False), ctx_size=64)
    b = colibri.load(ckpt.coli("llama4_text", "f32", fused=True), ctx_size=64)
    try:
        assert a.container.model_type == "llama4_text"
        assert torch.equal(a.logits(PROMPT), b.logits(PROMPT))
    finally:
        a.close()
        b.close()
    # a quantization_config sits at the top of such folders: it stays with the text model's config
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert text_model_config({"model_type": "llama4", "text_config": {"hidden_size": 8},
                              "quantization_config": qc}) == {"hidden_size": 8, "model_type": "llama4_text",
                                                              "quantization_config": qc}


@pytest.mark.skipif(not native.available(), reason="native kernels")
def test_positions_past_the_temperature_table_leave_the_native_blocks(ckpt, monkeypatch) -> None:
    """The native block reads the layer's temperature table; a position past it takes torch's layer, which
    computes the same formula: the one-call step stops applying there, and the tokens stay the same."""
    from colibri.engine import native_step

    llm = colibri.load(ckpt.coli("llama4_text", "int8", fused=True), ctx_size=64, threads=2)
    runs: list[bool] = []
    monkeypatch.setattr(native_step, "steps", _spy(native_step.steps, runs))
    try:
        full = list(llm.generate_ids(PROMPT[:12], max_tokens=16, temperature=0, speculative="off"))
        nope = [b.self_attn for b in llm.model.model.layers if b.self_attn.temperature is not None]
        assert nope
        for a in nope:  # 3 entries: positions below 2 * floor_scale - 1 = 7
            a.temp = a.temp[:3].clone()
            a._fused_layer = None
        llm.plan.rebuild()
        assert all(a.pos_limit() == 7 for a in nope)
        assert runs and all(runs)  # native runs took the steps
        runs.clear()
        cut = list(llm.generate_ids(PROMPT[:12], max_tokens=16, temperature=0, speculative="off"))
    finally:
        llm.close()
    assert cut == full
    assert runs and not any(runs)  # every position is past 7: no native run took a step


def _spy(real, seen: list[bool]):
    def spy(*a, **kw):
        r = real(*a, **kw)
        seen.append(r is not None)
        return r
    return spy
