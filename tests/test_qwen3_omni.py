"""Qwen3-Omni's thinker text model: variants against transformers' thinker fed text, the released omni folder
(`qwen3_omni_moe`: the thinker under `thinker.` beside the talker and code2wav, its config under
`thinker_config.text_config`) giving the same model as the thinker saved alone, the names, and what is refused by
name. Its oracle in both layouts, batch, prompt-cache, tier and one-call tests run with every family's
(tests/tiny_configs.py FAMILIES)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from oracle_check import matches_transformers
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.qwen3_omni_moe_text import check_config, sanitize
from tests.hf_tiny import tiny_config_kwargs

FAMILY = "qwen3_omni_moe_text"
PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


@pytest.mark.parametrize("over", [
    {"norm_topk_prob": True, "mlp_only_layers": []},  # the router renormalised, every layer sparse
    # every other layer sparse, another RoPE base and sections (the same text positions)
    {"decoder_sparse_step": 2, "mlp_only_layers": [], "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2], "mrope_interleaved": True}},
])
def test_variants_match_transformers(ckpt, over: dict) -> None:
    matches_transformers(ckpt, FAMILY, over, PROMPT)


def test_released_omni_folder_is_the_thinker(ckpt, tmp_path) -> None:
    """The release: one folder for the thinker, the talker and code2wav, the thinker's tensors under `thinker.`
    and its text config under `thinker_config`. Converted, it is the model the thinker saved alone converts to:
    the same tensors, the same logits; the talker's, code2wav's and the encoders' tensors listed as dropped."""
    thinker = ckpt.hf(FAMILY)
    src = tmp_path / "omni"
    shutil.copytree(thinker, src)
    tensors = load_file(str(src / "model.safetensors"))
    released = {f"thinker.{k}": v for k, v in tensors.items()}
    released["talker.model.layers.0.mlp.gate.weight"] = torch.zeros(4, 8)
    released["talker.codec_head.weight"] = torch.zeros(8, 8)
    released["code2wav.decoder.0.conv.weight"] = torch.zeros(2, 2, 3)
    (src / "model.safetensors").unlink()
    save_file(released, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((thinker / "config.json").read_text())
    omni = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
            "enable_audio_output": True, "thinker_config": cfg,
            "talker_config": {"model_type": "qwen3_omni_moe_talker"}}
    (src / "config.json").write_text(json.dumps(omni))
    got = convert(src, tmp_path / "omni.coli", "f32", 32, progress=False)
    ref = ckpt.coli(FAMILY, "f32")
    with colibri.load(got, ctx_size=64, threads=2) as a, colibri.load(ref, ctx_size=64, threads=2) as b:
        assert torch.equal(a.logits(PROMPT).float(), b.logits(PROMPT).float())
        from colibri.format.container import Container

        with Container(got) as c:
            assert c.model_type == FAMILY
            dropped = c.meta["converter"]["dropped"]
            assert "talker.codec_head.weight" in dropped and "code2wav.decoder.0.conv.weight" in dropped
            assert any(d.startswith("thinker.audio_tower.") for d in dropped)
            assert any(d.startswith("thinker.visual.") for d in dropped)


def test_names() -> None:
    assert sanitize("thinker.model.layers.3.mlp.experts.5.up_proj.weight") == \
        "model.layers.3.mlp.experts.5.up_proj.weight"
    assert sanitize("thinker.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert sanitize("thinker.lm_head.weight") == "lm_head.weight"
    assert sanitize("model.language_model.layers.0.mlp.experts.gate_up_proj") == \
        "model.layers.0.mlp.experts.gate_up_proj"
    assert sanitize("model.language_model.norm.weight") == "model.norm.weight"
    for gone in ("talker.model.layers.0.self_attn.q_proj.weight", "code2wav.upsample.0.weight",
                 "thinker.audio_tower.layers.0.fc1.weight", "audio_tower.conv2d1.weight",
                 "model.audio_tower.proj1.weight", "thinker.visual.blocks.0.attn.qkv.weight",
                 "visual.merger.mlp.0.weight", "model.visual.patch_embed.proj.weight"):
        assert sanitize(gone) is None, gone


@pytest.mark.parametrize("over,field", [
    ({"hidden_act": "gelu"}, "hidden_act"), ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
     "rope_type")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    cfg = {"model_type": FAMILY, **tiny_config_kwargs(FAMILY)}
    check_config(cfg)
    with pytest.raises(ColibriError, match=field):
        check_config({**cfg, **over})
