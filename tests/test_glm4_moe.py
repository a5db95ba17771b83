"""GLM-4.5 specifics beyond the oracle: configs we refuse, and multi-token-prediction layers we drop."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import hf_logits, load_hf, tiny_config_kwargs
from safetensors.torch import save_file

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models.glm4_moe import ModelArgs, check_config


def _cfg(**over):
    return {"model_type": "glm4_moe", **tiny_config_kwargs("glm4_moe"), **over}


@pytest.mark.parametrize("field, value, named", [
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("hidden_act", "gelu", "hidden_act"),
    ("n_group", 3, "n_group"),  # 8 experts do not split into 3 groups
    ("topk_group", 3, "topk_group"),  # more groups kept than exist (n_group=2)
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_type='dynamic'"),
])
def test_check_config_refuses_naming_the_field(field, value, named):
    with pytest.raises(ColibriError, match=named):
        check_config(_cfg(**{field: value}))


def test_check_config_accepts_the_tiny_and_real_shapes():
    check_config(_cfg())
    check_config(_cfg(n_routed_experts=128, n_group=1, topk_group=1, scoring_func="sigmoid",
                      topk_method="noaux_tc"))


def test_partial_rotary_factor_v4_and_v5_spellings():
    base = _cfg(rope_parameters=None)
    assert ModelArgs.from_dict({**base, "partial_rotary_factor": 0.25}).rotary_dim == 4  # v4: top level
    assert ModelArgs.from_dict({**base, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}}
                               ).rotary_dim == 16  # v5: inside rope_parameters
    assert ModelArgs.from_dict(base).rotary_dim == 8  # GLM's default: half the head


def test_mtp_layers_past_the_stack_are_dropped_with_no_mtp(ckpt, tmp_path):
    src = tmp_path / "glm_mtp"
    shutil.copytree(ckpt.hf("glm4_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    assert cfg["num_nextn_predict_layers"] == 1
    # What a real GLM-4.5 checkpoint carries for its MTP head: a whole extra layer plus eh_proj & co.
    g = torch.Generator().manual_seed(1)
    mtp = {f"model.layers.{n}.{k}": torch.randn(*s, generator=g) for k, s in {
        "eh_proj.weight": (64, 128), "enorm.weight": (64,), "hnorm.weight": (64,),
        "self_attn.q_proj.weight": (64, 64), "mlp.experts.0.up_proj.weight": (32, 64),
        "mlp.gate.e_score_correction_bias": (8,)}.items()}
    save_file(mtp, str(src / "mtp.safetensors"))

    with pytest.raises(ColibriError, match="lacks .* --no-mtp"):  # (kept by default: this one is partial)
        convert(src, tmp_path / "glm_mtp.coli", "f32", progress=False)
    dst = convert(src, tmp_path / "glm_mtp.coli", "f32", progress=False, keep_mtp=False)
    with Container(dst) as c:
        assert sorted(c.meta["converter"]["dropped"]) == sorted(mtp)
    ids = [1, 17, 42, 99, 7, 150]
    llm = colibri.load(dst, ctx_size=32, threads=2)
    assert (llm.logits(ids) - hf_logits(load_hf(src), ids)).abs().max().item() < 1e-4

    # Without the config saying so, an extra layer is not silently ignored.
    (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ColibriError, match="does not use"):
        convert(src, tmp_path / "glm_nomtp.coli", "f32", progress=False)


def test_one_group_routing_runs_in_the_kernels_and_gives_torchs_tokens(ckpt, monkeypatch):
    """GLM-4.5's released configs have one expert group: its router then runs in the native kernels at
    bf16 (the sigmoid rule, kernels/route.c), and decodes the tokens the torch router gives; the logits at
    f32 stay transformers' (the oracle path)."""
    from colibri.models import glm4_moe

    path = ckpt.coli("glm4_moe", "int4", n_group=1, topk_group=1)
    ids = [1, 17, 42, 99, 7, 150, 23, 64]
    native_calls = []
    from colibri.kernels import native_run

    for mod, name in ((glm4_moe.native, "route"), (glm4_moe.native, "decode_step"), (native_run, "decode_run")):
        real = getattr(mod, name)  # per layer, or inside the one-call step
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: native_calls.append(_n) or _r(*a, **k))
    with colibri.load(path) as llm:
        got = list(llm.generate_ids(ids, max_tokens=12, ignore_eos=True))
    assert "decode_step" in native_calls  # the whole step (dense layer, shared experts) in the kernels
    monkeypatch.setattr(glm4_moe.GroupLimitedRouter, "native_routing", lambda self: None)  # the torch router
    with colibri.load(path) as llm:
        assert list(llm.generate_ids(ids, max_tokens=12, ignore_eos=True)) == got
    src = ckpt.hf("glm4_moe", n_group=1, topk_group=1)
    with colibri.load(ckpt.coli("glm4_moe", "f32", n_group=1, topk_group=1)) as llm:
        torch.testing.assert_close(llm.logits(ids), hf_logits(load_hf(src), ids), rtol=1e-4, atol=1e-4)
