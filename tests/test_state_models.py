"""The families whose layers keep a per-sequence state instead of K/V positions (LFM2's short convolutions, the
Mamba-2 layers of Granite 4.0-H and Nemotron-H, Jamba's Mamba, MiniMax's lightning attention, Kimi-Linear's KDA): a
prompt read in chunks and a batch of three continue each sequence's states and give transformers' greedy tokens;
prompt caching stays off and prompt cache files are refused (a state cannot be rewound: engine/kv.py
`SlotPool.rewindable`). (Qwen3-Next's in tests/test_qwen3_next.py.)"""

from __future__ import annotations

import pytest
from hf_tiny import hf_greedy, load_hf

import colibri
from colibri.errors import ColibriError

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
FAMILIES = ["lfm2_moe", "granitemoehybrid", "jamba", "nemotron_h", "minimax", "kimi_linear", "bailing_hybrid"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_chunked_prompts_and_batches_continue_each_state(ckpt, model_type: str) -> None:
    hf = load_hf(ckpt.hf(model_type))
    prompts = [PROMPT * 2, PROMPT[:5], PROMPT[3:] * 3]
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=96, threads=2, slots=3, prefill_chunk=5) as llm:
        got = [h.wait() for h in [llm.submit(p, 8, ignore_eos=True) for p in prompts]]
    assert got == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prompt_caching_stays_off_and_saved_caches_are_refused(ckpt, tmp_path, model_type: str) -> None:
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=96, threads=2, slots=1) as llm:
        assert not llm.slots.rewindable
        a = llm.submit(PROMPT, 4, ignore_eos=True).wait()
        h = llm.submit(PROMPT + a, 4, ignore_eos=True)
        h.wait()
        assert h.stats.cached_tokens == 0
        with pytest.raises(ColibriError, match="keep a state"):
            llm.save_prompt_cache(tmp_path / "slot.bin")
