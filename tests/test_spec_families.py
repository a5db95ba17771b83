"""Speculative decoding on every family (the identity gate): at f32, drafts right up to a depth that cycles through
every rollback length, and then a draft model (the family itself at int8), give plain greedy decoding's tokens
(the sparse-attention families past their dense span: ctx 64 against 8 or 12 positions kept)."""

from __future__ import annotations

import pytest
from test_speculative import _source
from tiny_configs import FAMILIES

import colibri
from colibri.kernels import native

PROMPT = [1, 88, 5, 61, 230, 12, 9]
N = 24


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_verifies_to_plain_tokens(ckpt, monkeypatch, model_type) -> None:
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=64, threads=2) as llm:
        ref = llm.submit(PROMPT, N, temperature=0, ignore_eos=True, speculative="off").wait()
        with monkeypatch.context() as mp:
            _source(mp, ref, len(PROMPT), "cycle")
            h = llm.submit(PROMPT, N, temperature=0, ignore_eos=True, speculative="lookup", draft_max=4)
            got = h.wait()
    assert got == ref and 0 < h.stats.accepted < h.stats.drafted


@pytest.mark.parametrize("model_type", ["qwen2_moe", "glm4_moe", "llama4_text", "ernie4_5_moe", "phimoe",
                                        "granitemoe", "dbrx", "gemma4_text", "longcat_flash", "minimax_m2"])
def test_a_draft_model_on_more_families(ckpt, model_type) -> None:
    """The family at int8 as its own f32 model's draft (mostly right, not always)."""
    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=64, threads=2,
                      draft_model=ckpt.coli(model_type, "int8")) as llm:
        llm._draft.p_min = 0.0
        ref = llm.submit(PROMPT, N, temperature=0, ignore_eos=True, speculative="off").wait()
        h = llm.submit(PROMPT, N, temperature=0, ignore_eos=True, speculative="draft", draft_max=4)
        got = h.wait()
    assert got == ref and h.stats.drafted > 0
