"""GLM-4.5V / 4.6V as released (`glm4v_moe`: the text model under `text_config` and `model.language_model.`, a vision
tower beside it) converts to its text model, GLM-4.5's layers. The oracle, batch, tier and prompt-cache tests run it
with every family (tests/tiny_configs.py FAMILIES: built and saved as the multimodal model); here its own rules."""

from __future__ import annotations

import pytest

from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models.glm4v_moe_text import check_config, sanitize


def test_the_vision_tower_is_dropped_and_the_text_model_kept(ckpt) -> None:
    with Container(ckpt.coli("glm4v_moe_text", "f32")) as c:
        dropped = c.meta["converter"]["dropped"]
        assert c.model_type == "glm4v_moe_text" and not any("visual" in n for n in c.names())
        assert c.config["attention_bias"] and c.config["first_k_dense_replace"] == 1
    assert dropped and all(n.startswith("model.visual.") for n in dropped)


def test_names_and_glm_refusals() -> None:
    assert sanitize("model.language_model.layers.1.mlp.gate.e_score_correction_bias") == \
        "model.layers.1.mlp.gate.e_score_correction_bias"
    assert sanitize("model.visual.blocks.0.attn.qkv.weight") is None and sanitize("lm_head.weight") == "lm_head.weight"
    with pytest.raises(ColibriError, match="glm4v_moe_text"):
        check_config({"hidden_act": "gelu"})
