"""Phi-3.5-MoE (`phimoe`). The oracle, batch, tier, prompt-cache and native-accuracy tests run it with every family
(tests/tiny_configs.py FAMILIES: LayerNorms, biases, the sparsemixer router, longrope past 16 positions); here its
own pieces against transformers' and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer

import colibri
from colibri.convert.converter import convert
from colibri.engine.decode_plan import DecodePlan
from colibri.errors import ColibriError
from colibri.format.validate import check_config as validate_config
from colibri.layers.layers import is_rms, rope_inv_freq
from colibri.models.phimoe import SparsemixerRouter, check_config, sanitize


@pytest.mark.parametrize("jitter", [0.01, 0.3, 2.0])
def test_the_router_is_transformers_sparsemixer(jitter: float) -> None:
    """Both experts and both weights, for a jitter that masks almost every other expert, some, or none."""
    torch.manual_seed(0)
    r = SparsemixerRouter(32, 8, jitter)
    r.weight.data = torch.randn(8, 32)
    x = torch.randn(50, 32)
    idx, w = r(x)
    ref_w, ref_idx = sparsemixer(x @ r.weight.T, jitter_eps=jitter, training=False)
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    assert (idx[:, 0] != idx[:, 1]).all()
    if jitter == 0.3:  # (neither always 1 nor always shared: the mask matters here)
        assert (w[:, 0] < 1).any() and (w[:, 0] == 1).any()


def test_longrope_takes_the_short_factors_and_scale(ckpt) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(ckpt.hf("phimoe"))
    ref, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg)  # (no length: the short factors, as phimoe's forward asks)
    scaling = json.loads((ckpt.hf("phimoe") / "config.json").read_text())["rope_parameters"]
    inv, mscale = rope_inv_freq(16, scaling["rope_theta"], scaling, 256)
    assert torch.equal(inv, ref) and mscale == scaling["short_mscale"]


def test_the_native_blocks_take_phis_layers(ckpt) -> None:
    """bf16 / int8 run Phi's layers in the kernels: the attention block with its LayerNorms, the sparsemixer rule,
    the one-call step with the final LayerNorm and the head's bias (tests/test_native_step.py: the same bits as
    the kernels called one by one; tests/test_native_accuracy.py: as accurate as torch's path)."""
    from colibri.engine import native_step

    with colibri.load(ckpt.coli("phimoe", "int8"), ctx_size=64, threads=2) as llm:
        m = llm.model
        for b in m.model.layers:
            assert not is_rms(b.input_layernorm)
            assert b.self_attn._native_layer(b.input_layernorm, b.post_attention_layernorm) is not None
            assert b.mlp.gate.native_routing() is not None
        assert native_step.tail(m) is not None and DecodePlan(m).native_layers() is not None
        assert m.lm_head.bias is not None and m.model.norm.bias is not None


def test_names_and_refusals(ckpt, tmp_path) -> None:
    assert sanitize("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert sanitize("model.layers.3.mlp.router.weight") == "model.layers.3.mlp.gate.weight"
    assert sanitize("model.layers.3.block_sparse_moe.experts.1.w2.weight") == "model.layers.3.mlp.experts.1.w2.weight"
    base = json.loads((ckpt.hf("phimoe") / "config.json").read_text())
    rope = base["rope_parameters"]
    bad = {
        "exactly 2 experts": {"num_experts_per_tok": 3},
        "equal to long_mscale": {"rope_parameters": {**rope, "long_mscale": 1.5}},
        "only silu": {"hidden_act": "gelu"},
    }
    for want, change in bad.items():
        with pytest.raises(ColibriError, match=want):
            check_config({**base, **change})
    with pytest.raises(ColibriError, match="short_factor must be a non-empty list"):
        validate_config("phimoe", {**base, "rope_parameters": {**rope, "short_factor": 1.0}})
    # A short_factor of the wrong length: one line at conversion, no traceback.
    src = tmp_path / "hf"
    src.mkdir()
    for f in ckpt.hf("phimoe").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "config.json").write_text(json.dumps({**base, "rope_parameters": {**rope, "short_factor": [1.0] * 3}}))
    with pytest.raises(ColibriError, match="short_factor has 3 entries for 8 frequencies"):
        convert(src, tmp_path / "m.coli", "f32", 32, progress=False)
