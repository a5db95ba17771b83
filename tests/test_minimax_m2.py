"""MiniMax-M2: config refusals and the rotary width, both checkpoint layouts against transformers, and the
one-call native step (its sigmoid router runs in the kernels)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import encode, hf_logits, load_hf, make_tiny_checkpoint, tiny_config_kwargs

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.models.minimax_m2 import ModelArgs, check_config, sanitize

PROMPT_IDS = encode("The expert cache keeps the experts the next tokens need.")


def _cfg(**over) -> dict:
    return {"model_type": "minimax_m2", **tiny_config_kwargs("minimax_m2"), **over}


@pytest.mark.parametrize("field,value,named", [
    ("scoring_func", "softmax", "scoring_func"),
    ("shared_intermediate_size", 64, "shared_intermediate_size"),
    ("attn_type_list", [0, 1, 1], "attn_type_list"),  # MiniMax-Text-01's lightning attention layers
    ("rotary_dim", 7, "rotary_dim"),
    ("hidden_act", "gelu", "hidden_act"),
    ("qk_norm_type", "per_head", "qk_norm_type"),
    ("use_routing_bias", False, "use_routing_bias"),
])
def test_check_config_refuses_naming_the_field(field, value, named):
    check_config(_cfg())
    with pytest.raises(ColibriError, match=named):
        check_config(_cfg(**{field: value}))


def test_rotary_width_from_either_spelling():
    base = {k: v for k, v in _cfg().items() if k not in ("rotary_dim", "rope_parameters")}
    assert ModelArgs.from_dict({**base, "rotary_dim": 8}).rotary_dim == 8  # the released configs' field
    v5 = {**base, "rope_parameters": {"rope_theta": 5e6, "partial_rotary_factor": 0.25}}
    assert ModelArgs.from_dict(v5).rotary_dim == 8  # transformers' spelling (head_dim 32)
    assert ModelArgs.from_dict(base).rotary_dim == 32  # neither: the whole head


def test_names_of_the_released_layout_map_to_the_routers():
    assert sanitize("model.layers.3.block_sparse_moe.e_score_correction_bias") == \
        "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.mlp.e_score_correction_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert sanitize("model.layers.3.block_sparse_moe.experts.5.w1.weight") == "model.layers.3.mlp.experts.5.w1.weight"


def test_both_layouts_convert_to_transformers_logits(ckpt, tmp_path):
    """The released layout (`block_sparse_moe`, per-expert w1/w2/w3, save_pretrained) and transformers'
    in-memory one (fused experts, the bias on the MoE block) give transformers' logits at f32."""
    want = hf_logits(load_hf(ckpt.hf("minimax_m2")), PROMPT_IDS)
    fused = make_tiny_checkpoint("minimax_m2", tmp_path / "fused", fused=True)
    for src in (ckpt.hf("minimax_m2"), fused):
        with colibri.load(convert(src, tmp_path / f"{src.name}.coli", "f32", progress=False)) as llm:
            torch.testing.assert_close(llm.logits(PROMPT_IDS), want, rtol=1e-4, atol=1e-4)


def test_int4_decode_takes_the_one_call_step(ckpt):
    """Its router (sigmoid, selection bias) is one the kernels run: the whole decode step is one native call
    (coli_decode_step), or several in one (coli_decode_run, a lone greedy request)."""
    from colibri.kernels import native, native_run

    calls = []
    step, run = native.decode_step, native_run.decode_run

    def spy_step(*a, **k):
        calls.append(1)
        return step(*a, **k)

    def spy_run(*a, **k):
        out = run(*a, **k)
        calls.append(len(out[0]))
        return out

    native.decode_step, native_run.decode_run = spy_step, spy_run
    try:
        with colibri.load(ckpt.coli("minimax_m2", "int4")) as llm:
            out = list(llm.generate_ids(PROMPT_IDS, max_tokens=6, ignore_eos=True))
    finally:
        native.decode_step, native_run.decode_run = step, run
    assert len(out) == 6 and sum(calls) >= 5  # steps (the prompt may be one larger step)
