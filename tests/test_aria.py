"""Aria's text model: variants against transformers' AriaTextForCausalLM, the released multimodal folder (`aria`: the
text model under `language_model.`, the vision tower and projector beside) giving the same model as the text model
saved alone, the names, the x @ W experts, and what is refused by name. Its oracle in both layouts, batch,
prompt-cache, tier and one-call tests run with every family's (tests/tiny_configs.py FAMILIES)."""

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
from colibri.format.container import Container
from colibri.models.aria_text import check_config, expert_record, sanitize
from tests.hf_tiny import tiny_config_kwargs

FAMILY = "aria_text"
PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


@pytest.mark.parametrize("over", [
    {"moe_num_shared_experts": 3, "attention_bias": False},  # three shared experts' width, no biases
    {"moe_topk": 3, "moe_num_shared_experts": 1, "num_key_value_heads": 4,  # top 3, one shared expert, MHA,
     "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},  # Llama 3's RoPE
])
def test_variants_match_transformers(ckpt, over: dict) -> None:
    matches_transformers(ckpt, FAMILY, over, PROMPT)


def test_released_folder_is_the_text_model(ckpt, tmp_path) -> None:
    """The release: `language_model.model.` / `language_model.lm_head`, the vision tower and projector beside, the
    text config under `text_config`. Converted, it is the model the text model saved alone converts to."""
    text = ckpt.hf(FAMILY)
    src = tmp_path / "aria"
    shutil.copytree(text, src)
    tensors = load_file(str(src / "model.safetensors"))
    released = {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): v for k, v in tensors.items()}
    released["vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(8, 4)
    released["multi_modal_projector.cross_attn.q_proj.weight"] = torch.zeros(4, 4)
    (src / "model.safetensors").unlink()
    save_file(released, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((text / "config.json").read_text())
    release = {"model_type": "aria", "architectures": ["AriaForConditionalGeneration"], "text_config": cfg,
               "vision_config": {"hidden_size": 4}}
    (src / "config.json").write_text(json.dumps(release))
    got = convert(src, tmp_path / "aria.coli", "f32", 32, progress=False)
    with colibri.load(got, ctx_size=64, threads=2) as a, colibri.load(ckpt.coli(FAMILY, "f32"), ctx_size=64,
                                                                        threads=2) as b:
        assert torch.equal(a.logits(PROMPT).float(), b.logits(PROMPT).float())
    with Container(got) as c:
        assert c.model_type == FAMILY
        dropped = c.meta["converter"]["dropped"]
        assert "vision_tower.encoder.layers.0.mlp.fc1.weight" in dropped
        assert "multi_modal_projector.cross_attn.q_proj.weight" in dropped


def test_experts_are_x_times_w() -> None:
    """gate_up [hidden, 2I] with the gate columns first, down [I, hidden]: as transformers' AriaExperts computes."""
    H, i = 6, 4
    gu, dn = torch.randn(H, 2 * i), torch.randn(i, H)
    rec = expert_record({"gate_up": gu, "down": dn})
    x = torch.randn(3, H)
    gate, up = (x @ gu).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ dn
    g2, u2 = (x @ rec["gate_up.weight"].T).chunk(2, dim=-1)
    torch.testing.assert_close((torch.nn.functional.silu(g2) * u2) @ rec["down.weight"].T, want)
    with pytest.raises(ColibriError, match="not"):
        expert_record({"gate_up": gu.T, "down": dn.T})


def test_names() -> None:
    assert sanitize("language_model.model.layers.2.mlp.experts.fc1.weight") == "model.layers.2.mlp.experts.gate_up_proj"
    assert sanitize("model.language_model.layers.2.mlp.experts.fc2.weight") == "model.layers.2.mlp.experts.down_proj"
    assert sanitize("model.layers.2.mlp.router.weight") == "model.layers.2.mlp.gate.weight"
    assert sanitize("language_model.lm_head.weight") == "lm_head.weight"
    assert sanitize("model.layers.0.mlp.shared_experts.up_proj.weight") == \
        "model.layers.0.mlp.shared_experts.up_proj.weight"
    for gone in ("vision_tower.encoder.layers.0.self_attn.q_proj.weight", "multi_modal_projector.query",
                 "model.vision_tower.embeddings.patch_embedding.weight", "model.multi_modal_projector.ln_ffn.weight"):
        assert sanitize(gone) is None, gone


@pytest.mark.parametrize("over,field", [({"mlp_bias": True}, "mlp_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                                        ({"moe_num_shared_experts": 0}, "moe_num_shared_experts"),
                                        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                                         "rope_type")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    cfg = {"model_type": FAMILY, **tiny_config_kwargs(FAMILY)}
    check_config(cfg)
    with pytest.raises(ColibriError, match=field):
        check_config({**cfg, **over})
