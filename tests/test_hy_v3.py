"""Hy3 (hy_v3): the release's names mapped, its multi-token-prediction layer dropped, transformers' defaults (the
dense layer, RoPE's base) where a config leaves them out, refusals by name. Its oracle, batch, prompt-cache, tier
and one-call tests run with every family's (tests/tiny_configs.py: dense layer 1, a head wider than
hidden / heads, the router's scale)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, tiny_config_kwargs
from transformers import HYV3Config

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.hy_v3 import ModelArgs, check_config, sanitize

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "hy_v3", **tiny_config_kwargs("hy_v3"), **over}


def test_release_names_map_to_the_canonical_ones() -> None:
    assert sanitize("model.layers.3.mlp.router.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert sanitize("model.layers.3.mlp.expert_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.mlp.shared_mlp.up_proj.weight") \
        == "model.layers.3.mlp.shared_experts.up_proj.weight"
    # transformers' own names (a state_dict saved as it is in memory)
    assert sanitize("model.layers.3.mlp.e_score_correction_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.mlp.experts.5.up_proj.weight") == "model.layers.3.mlp.experts.5.up_proj.weight"


@pytest.mark.parametrize("n", [3, 5])
def test_default_layer_pattern_is_transformers(n: int) -> None:
    """A hub config without the derived list: layer 0 dense, the rest sparse, as HYV3Config decides."""
    kw = {k: v for k, v in tiny_config_kwargs("hy_v3").items() if k != "mlp_layer_types"}
    ref = HYV3Config(**{**kw, "num_hidden_layers": n})
    a = ModelArgs.from_dict({"model_type": "hy_v3", **kw, "num_hidden_layers": n})
    assert [a.is_moe(i) for i in range(n)] == [t == "sparse" for t in ref.mlp_layer_types]
    assert ModelArgs.default_theta == HYV3Config.default_theta


def test_default_rope_base_gives_transformers_logits(ckpt, tmp_path) -> None:
    """The saved config without `rope_parameters`: transformers' default base (11158840), not RoPE's usual 1e4."""
    src = edited_copy(ckpt.hf("hy_v3"), tmp_path / "src", drop=("rope_parameters",))
    assert "rope_parameters" not in (src / "config.json").read_text()
    convert(src, tmp_path / "m.coli", "f32", progress=False)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.config.rope_parameters["rope_theta"] == HYV3Config.default_theta
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]  # [T, V]
    with colibri.load(tmp_path / "m.coli", ctx_size=64, threads=2) as llm:
        got = llm.logits(IDS)
    assert torch.allclose(got, want, atol=2e-4, rtol=0)


def test_mtp_layer_is_dropped_with_no_mtp_and_recorded(ckpt, tmp_path) -> None:
    """The release's MTP layer past the stack (model.layers.80: a decoder layer, its input projection and norms, a
    copy of the head), dropped and listed with --no-mtp (kept otherwise: tests/test_spec_mtp.py)."""
    def mtp(base: dict) -> dict:
        H = base["model.norm.weight"].shape[0]
        own = {"enorm.weight": torch.ones(H), "hnorm.weight": torch.ones(H), "final_layernorm.weight": torch.ones(H),
               "eh_proj.weight": torch.randn(H, 2 * H), "shared_head.weight": base["lm_head.weight"].clone()}
        return {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in base.items()
                if k.startswith("model.layers.2.")} | {f"model.layers.3.{k}": v for k, v in own.items()}

    src = edited_copy(ckpt.hf("hy_v3"), tmp_path / "src")
    converts_dropping(src, mtp, ckpt.coli("hy_v3", "f32"), tmp_path / "m.coli", IDS, keep_mtp=False)


@pytest.mark.parametrize("over,field", [
    ({"mlp_layer_types": ["sparse", "dense"]}, "mlp_layer_types"),  # one short
    ({"mlp_layer_types": ["sparse", "moe", "sparse"]}, "mlp_layer_types"),
    ({"n_group": 2, "topk_group": 1}, "n_group"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"num_shared_experts": 0}, "num_shared_experts"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))


def test_a_bad_layer_pattern_is_refused_at_convert(ckpt, tmp_path) -> None:
    src = edited_copy(ckpt.hf("hy_v3"), tmp_path / "src", mlp_layer_types=["dense"])
    with pytest.raises(ColibriError, match="mlp_layer_types"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)
