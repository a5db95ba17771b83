"""The family tests' oracle comparison of a config variant: the converted f32 model's logits over a prompt (three times
over: past the tiny models' windows and SSD chunks) within `bound` of transformers', and its greedy tokens equal."""

from __future__ import annotations

from hf_tiny import hf_greedy_with_logits, hf_logits, load_hf

import colibri


def matches_transformers(ckpt, model_type: str, over: dict, prompt: list[int], bound: float = 1e-4, hf=None) -> None:
    """`hf`: the transformers model of that variant when the caller loaded it already (to hook it)."""
    hf = hf if hf is not None else load_hf(ckpt.hf(model_type, **over))
    ref = hf_logits(hf, prompt * 3)
    with colibri.load(ckpt.coli(model_type, "f32", **over), ctx_size=64, threads=2) as llm:
        assert (llm.logits(prompt * 3).float() - ref).abs().max() < bound
        want, _ = hf_greedy_with_logits(hf, prompt, 8)
        assert list(llm.generate_ids(prompt, 8, temperature=0, ignore_eos=True)) == want
