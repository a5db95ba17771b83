"""Qwen3-VL MoE as released (`qwen3_vl_moe`: the text model under `text_config` and `model.language_model.`, a vision
tower beside it, fused experts stored x @ W) converts to its text model. The oracle, batch, tier and prompt-cache tests
run it with every family (tests/tiny_configs.py FAMILIES: built and saved as the multimodal model, its experts
transposed as the hub's are); here its own rules."""

from __future__ import annotations

import pytest
import torch

import colibri
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models.qwen3_vl_moe_text import ModelArgs, expert_record, sanitize


def test_the_vision_tower_is_dropped_and_the_text_model_kept(ckpt) -> None:
    with Container(ckpt.coli("qwen3_vl_moe_text", "f32")) as c:
        dropped = c.meta["converter"]["dropped"]
        assert c.model_type == "qwen3_vl_moe_text" and not any("visual" in n for n in c.names())
    assert dropped and all(n.startswith("model.visual.") for n in dropped)


def test_names_and_the_router_rule() -> None:
    name = "layers.2.mlp.experts.gate_up_proj"
    assert sanitize(f"model.language_model.{name}") == f"model.{name}"
    assert sanitize("model.visual.blocks.0.attn.qkv.weight") is None and sanitize("lm_head.weight") == "lm_head.weight"
    a = ModelArgs.from_dict({"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_local_experts": 8,
                             "num_experts_per_tok": 2, "vocab_size": 384, "norm_topk_prob": False})
    assert a.norm_topk_prob and a.num_experts == 8  # (transformers' router always renormalises)


def test_both_fused_layouts_give_one_record() -> None:
    h, i = 16, 12
    gu, dn = torch.randn(2 * i, h), torch.randn(h, i)
    ours = expert_record({"gate_up": gu, "down": dn})
    hub = expert_record({"gate_up": gu.T.contiguous(), "down": dn.T.contiguous()})  # x @ W, as released
    for r in (ours, hub):
        assert torch.equal(r["gate_up.weight"], gu) and torch.equal(r["down.weight"], dn)
    with pytest.raises(ColibriError, match="fit neither layout"):
        expert_record({"gate_up": torch.randn(2 * i, h), "down": torch.randn(i + 1, h)})
    with pytest.raises(ColibriError, match="lacks gate_up/down"):
        expert_record({"gate": gu[:i], "up": gu[i:], "down": dn})


def test_int8_decodes_in_the_one_call_step(ckpt, monkeypatch) -> None:
    """At int8 its Qwen3-MoE layers take the whole-step native call (the same tokens as the layer-by-layer path)."""
    from colibri.engine import native_step
    from colibri.kernels import native

    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    path = ckpt.coli("qwen3_vl_moe_text", "int8")
    calls = []
    real = native.decode_step
    monkeypatch.setattr(native, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = colibri.load(path, ctx_size=64, threads=2)
    fast = list(llm.generate_ids([1, 17, 42, 99, 7], 12, temperature=0, ignore_eos=True, logprobs=1))
    llm.close()
    monkeypatch.setattr(native_step, "build", lambda *a, **k: "asked for torch")
    llm = colibri.load(path, ctx_size=64, threads=2)
    slow = list(llm.generate_ids([1, 17, 42, 99, 7], 12, temperature=0, ignore_eos=True, logprobs=1))
    llm.close()
    assert calls and fast == slow
