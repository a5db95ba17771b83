"""Prompt caching: a request reuses the K/V a free slot holds for the start of its prompt, and gets
exactly the tokens of a run that computes the whole prompt (and transformers' tokens)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_greedy, load_hf

import colibri
from colibri.engine.kv import SlotPool, common_prefix
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.models.family import supported

P1 = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
P2 = [1, 88, 5, 61, 9, 12]
N = 8
# (Qwen3-Next's linear-attention states and the short-convolution, Mamba and lightning states cannot keep a prefix:
# tests/test_qwen3_next.py and tests/test_state_models.py show caching stays off)
CACHEABLE = [m for m in supported() if m not in ("qwen3_next", "qwen3_5_moe_text", "lfm2_moe",
                                         "granitemoehybrid", "jamba", "nemotron_h", "minimax", "kimi_linear",
                                         "bailing_hybrid")]


def run(llm, prompt: list[int], n: int = N, **kw) -> tuple[list[int], int]:
    """Greedy tokens of one request and how many of its prompt tokens were cached."""
    h = llm.submit(prompt, n, ignore_eos=True, **kw)
    return h.wait(), h.stats.cached_tokens


@pytest.mark.parametrize("model_type", CACHEABLE)
def test_cached_prefixes_give_the_tokens_of_a_full_prefill(ckpt, model_type):
    path = ckpt.coli(model_type, "f32")
    with colibri.load(path, ctx_size=96, threads=2, slots=1) as llm:
        a, cached = run(llm, P1)
        assert cached == 0
        follow = P1 + a + [33, 71, 8]  # the next turn: the previous prompt and answer, then new text
        b, cached_b = run(llm, follow)
        assert cached_b == len(P1) + N - 1  # the answer's last token was never fed
        again, cached_again = run(llm, follow)  # the same prompt again: all but its last token
        assert cached_again == len(follow) - 1
        branch = follow[:5] + [44, 45, 46]  # shares 5 tokens with what the slot holds
        c, cached_c = run(llm, branch)
        assert cached_c == 5
    hf = load_hf(ckpt.hf(model_type))
    with colibri.load(path, ctx_size=96, threads=2, slots=1, cache_prompt=False) as full:
        for prompt, got in ((P1, a), (follow, b), (follow, again), (branch, c)):
            ref, cached = run(full, prompt)
            assert cached == 0
            assert got == ref == hf_greedy(hf, prompt, N), prompt


def test_a_request_takes_the_slot_that_holds_its_prefix(ckpt):
    path = ckpt.coli("olmoe", "f32")
    with colibri.load(path, ctx_size=96, threads=2, slots=3) as llm:
        h1, h2 = llm.submit(P1, N, ignore_eos=True), llm.submit(P2, N, ignore_eos=True)
        a1, a2 = h1.wait(), h2.wait()
        # Both slots are free again; each follow-up finds its own conversation's slot.
        b2, c2 = run(llm, P2 + a2 + [5])
        b1, c1 = run(llm, P1 + a1 + [5])
        assert (c1, c2) == (len(P1) + N - 1, len(P2) + N - 1)
        _, c3 = run(llm, [1, 250, 251])  # only BOS in common with any slot
        assert c3 == 1
        m = llm.metrics()
    with colibri.load(path, ctx_size=96, threads=2, slots=1, cache_prompt=False) as full:
        assert run(full, P1 + a1 + [5])[0] == b1
        assert run(full, P2 + a2 + [5])[0] == b2
    assert m["requests"] == 5


def test_prompt_scoring_and_route_traces_compute_every_prompt_token(ckpt, tmp_path):
    path = ckpt.coli("qwen3_moe", "f32")
    with colibri.load(path, ctx_size=96, threads=2, slots=1, cache_prompt=False) as full:
        want = full.logits(P1)
        scores = full.submit(P1, 0, prompt_logprobs=1)
        scores.wait()
    with colibri.load(path, ctx_size=96, threads=2, slots=1) as llm:
        run(llm, P1)
        assert torch.equal(llm.logits(P1), want)  # [T, V]: every row, none from the cache
        h = llm.submit(P1, 0, prompt_logprobs=1)
        h.wait()
        assert h.stats.cached_tokens == 0 and h.prompt_token_logprobs == scores.prompt_token_logprobs
        llm.trace_routing()  # the debug log needs every prompt token's routing
        assert run(llm, P1)[1] == 0
        llm.trace_routing(False)
        assert run(llm, P1)[1] == len(P1) - 1
    trace = tmp_path / "t.jsonl"
    with colibri.load(path, ctx_size=96, threads=2, slots=1, route_trace=trace) as llm:
        run(llm, P1)
        assert run(llm, P1)[1] == 0


class _Cache:
    nbytes = 8
    POS_DIM = 0

    def __init__(self):
        self.t = torch.zeros(32)

    def parts(self):
        return {"t": self.t}


class _Model:
    def make_cache(self, ctx, dtype, device="cpu", types=None):
        return [_Cache()]


def test_slot_pool_remembers_what_each_slot_holds():
    pool = SlotPool(_Model(), 2, 32, torch.float32, lambda i: torch.device("cpu"))
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    s0, held = pool.acquire([1, 2, 3])
    assert (s0, held) == (0, 0)
    pool.wrote(s0, 0, [1, 2, 3])
    pool.wrote(s0, 3, [9])  # a decode row
    pool.release(s0)
    s1, held = pool.acquire([5])  # nothing shared: the least recently used free slot
    assert (s1, held) == (1, 0)
    pool.release(s1)
    assert pool.acquire([1, 2, 3, 9, 7]) == (0, 4)
    pool.wrote(0, 2, [8])  # a chunk rewrote position 2 on: what followed is gone
    assert pool.tokens[0] == [1, 2, 8]
    pool.forget(0, 1)  # a failed step from position 1
    assert pool.tokens[0] == [1]
    pool.wrote(0, 3, [4])  # a write past what is known leaves nothing claimed beyond it
    assert pool.tokens[0] == [1]
    pool.release(0)
    assert pool.acquire([1, 2]) == (0, 1)
    assert pool.copied == 0
    pool.caches[0][0].t[0] = 7.0  # (what slot 0 computed for position 0)
    assert pool.acquire([1, 7]) == (1, 1)  # the busy slot 0 holds [1]: copied into the free slot 1
    assert pool.tokens[1] == [1] and pool.copied == 1
    assert pool.caches[1][0].t[0] == 7.0  # the K/V slot 0 holds for position 0
    assert pool.acquire([1]) is None


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3"])  # K/V caches, MLA latent caches
def test_a_prefix_held_by_another_slot_is_copied(ckpt, model_type):
    path = ckpt.coli(model_type, "f32")
    system = P1 + [33, 71, 8, 19, 140, 77]  # a system prompt every conversation starts with
    with colibri.load(path, ctx_size=96, threads=2, slots=2) as llm:
        first = llm.submit(system + [5, 6], 40, ignore_eos=True)
        next(iter(first))  # decoding in slot 0
        second = llm.submit(system + [9, 10, 11], N, ignore_eos=True)
        b = second.wait()
        first.wait()
        assert second.stats.cached_tokens == len(system)  # copied from the busy slot
        m = llm.metrics()
        assert m["prompt_positions_copied"] == len(system) and m["prompt_tokens_cached"] == len(system)
    with colibri.load(path, ctx_size=96, threads=2, slots=1, cache_prompt=False) as full:
        assert run(full, system + [9, 10, 11])[0] == b


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3"])
def test_requests_arriving_together_prefill_their_shared_prefix_once(ckpt, model_type):
    """n choices of one prompt, or conversations opening with one system prompt: the first computes
    the shared part, the others wait for it and copy it (they would share the steps' rows anyway)."""
    path = ckpt.coli(model_type, "f32")
    system = [1] + [(7 * i + 3) % 240 + 2 for i in range(59)]
    prompts = [system + [5, 6], system + [9, 10, 11], system + [5, 6], system[:40] + [12], P2]
    with colibri.load(path, ctx_size=128, threads=2, slots=5) as llm:
        with llm._sched.cond:  # the engine thread admits them all in one go
            hs = [llm.submit(p, N, ignore_eos=True) for p in prompts]
        got = [h.wait() for h in hs]
        assert [h.stats.cached_tokens for h in hs] == [0, 60, 61, 40, 0]  # P2 went in at once, beside the first
        assert llm.metrics()["prompt_tokens_cached"] == 161
    with colibri.load(path, ctx_size=128, threads=2, slots=1, cache_prompt=False) as full:
        assert [run(full, p)[0] for p in prompts] == got
    # A waiting request keeps its place: with two slots, the one after it waits for a slot to free.
    with colibri.load(path, ctx_size=128, threads=2, slots=2) as llm:
        with llm._sched.cond:
            hs = [llm.submit(p, N, ignore_eos=True) for p in (prompts[0], prompts[1], P2)]
        assert [h.wait() for h in hs] == [got[0], got[1], got[4]]
        assert hs[1].stats.cached_tokens == 60 and hs[1].stats.queued_s < hs[2].stats.queued_s
        assert hs[2].stats.queued_s > hs[0].stats.ttft_s  # it went in when the first one ended


@pytest.mark.skipif(not native.available(), reason="needs the native kernels (x86-64 AVX-512, a C compiler)")
def test_reduced_precision_conversation_is_bit_identical_with_the_cache(ckpt):
    """int8 (bf16 compute): prompt rows up to 512 go through the native kernels, which compute each
    row alone, so a chat's turns give the same tokens whether their prefix is cached or computed."""
    path = ckpt.coli("olmoe", "int8")
    conv, tail = list(P1), [33, 71, 8, 19, 140, 77, 5, 61, 12]
    with colibri.load(path, ctx_size=256, threads=2, slots=1) as llm, \
            colibri.load(path, ctx_size=256, threads=2, slots=1, cache_prompt=False) as full:
        for turn in range(5):
            got, cached = run(llm, conv, 12)
            assert got == run(full, conv, 12)[0], turn
            assert cached == (0 if turn == 0 else len(conv) - len(tail) - 1)
            conv = conv + got + tail


def test_a_failed_step_forgets_what_it_may_have_written(ckpt, monkeypatch):
    path = ckpt.coli("olmoe", "f32")
    with colibri.load(path, ctx_size=96, threads=2, slots=1) as llm:
        a, _ = run(llm, P1)
        calls = {"n": 0}

        def failing(*args, **kw):
            calls["n"] += 1
            raise ColibriError("injected failure")

        with monkeypatch.context() as mp:
            mp.setattr(llm.plan, "step", failing)  # (the step the runner runs: the decode plan's)
            h = llm.submit(P1 + a + [5, 6], N, ignore_eos=True)
            with pytest.raises(ColibriError, match="injected"):
                h.wait()
        assert calls["n"] == 1
        # The failed step ran from position len(P1) + N - 1 on: the slot still holds what came before.
        b, cached = run(llm, P1 + a + [5, 6])
        assert cached == len(P1) + N - 1
    with colibri.load(path, ctx_size=96, threads=2, slots=1, cache_prompt=False) as full:
        assert run(full, P1 + a + [5, 6])[0] == b


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3"])
def test_a_prompt_cache_file_serves_the_next_run(ckpt, tmp_path, model_type):
    path, cache = ckpt.coli(model_type, "f32"), tmp_path / "prompt.cache"
    with colibri.load(path, ctx_size=96, threads=2) as llm:
        a, _ = run(llm, P1)
        saved = llm.save_prompt_cache(cache)
    assert saved == len(P1) + N - 1
    follow = P1 + a + [5, 6]
    with colibri.load(path, ctx_size=96, threads=2) as llm:
        assert llm.load_prompt_cache(cache) == saved
        b, cached = run(llm, follow)
        assert cached == saved
    with colibri.load(path, ctx_size=96, threads=2, cache_prompt=False) as full:
        assert run(full, follow)[0] == b


def test_prompt_cache_files_are_checked(ckpt, tmp_path):
    cache, junk = tmp_path / "olmoe.cache", tmp_path / "junk.cache"
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=96, threads=2, slots=2) as llm:
        assert llm.save_prompt_cache(cache) == 0 and not cache.exists()  # an empty slot: nothing to save
        run(llm, P1)
        assert llm.save_prompt_cache(cache) > 0
        h = llm.submit(P2[1:], 60, ignore_eos=True)
        next(iter(h))  # nothing in common with slot 0: slot 1 (the least recently used) is busy now
        with pytest.raises(ColibriError, match="serving a request"):
            llm.save_prompt_cache(cache, slot=1)
        with pytest.raises(ColibriError, match="slot must be"):
            llm.save_prompt_cache(cache, slot=2)
        h.cancel()
    junk.write_bytes(b"\x80\x04not a pickle at all" * 10)
    with colibri.load(ckpt.coli("qwen3_moe", "f32"), ctx_size=96, threads=2) as other:
        with pytest.raises(ColibriError, match="another model"):
            other.load_prompt_cache(cache)
        with pytest.raises(ColibriError, match="not a colibri prompt cache"):
            other.load_prompt_cache(junk)
        assert run(other, P1)[1] == 0  # nothing was loaded
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=8, threads=2) as short:
        with pytest.raises(ColibriError, match="more than ctx-size"):
            short.load_prompt_cache(cache)


def test_run_prompt_cache_flag(ckpt, tmp_path, capsys):
    from colibri.cli.run import main

    path, cache = ckpt.coli("olmoe", "f32"), tmp_path / "p.cache"
    argv = ["--model", str(path), "--prompt", "Once upon a time there was a fox", "-n", "4", "--temperature", "0",
            "--prompt-cache", str(cache), "--ctx-size", "64"]
    main(argv)
    first = capsys.readouterr()
    assert cache.exists() and "cached)" not in first.err
    main(argv)
    second = capsys.readouterr()
    assert second.out == first.out and "cached)" in second.err
    cache.write_bytes(b"garbage")
    main(argv)  # a bad file is replaced, with a warning
    third = capsys.readouterr()
    assert third.out == first.out and "ignoring the prompt cache" in third.err
    with pytest.raises(ColibriError, match="no-cache-prompt"):
        main(argv + ["--no-cache-prompt"])


@pytest.mark.skipif(not native.available(), reason="needs the native kernels (x86-64 AVX-512, a C compiler)")
def test_a_long_prompt_rerun_from_its_cache_file_gives_the_same_tokens(ckpt, tmp_path):
    """int8: a prompt too long for the native plan is read in GEMM steps up to its last `short_prompt`
    rows, which go through the native kernels; a rerun that loads the rest from a file computes its last
    row there too, so the tokens and their log-probabilities (the logits' bits) are the same. (With the
    GEMM steps running to the prompt's end, as before, the first token's logprob differed: -0.038 vs
    -0.079.)"""
    path, cache = ckpt.coli("olmoe", "int8"), tmp_path / "p.cache"
    prompt = [1] + [3 + (7 * i) % 300 for i in range(299)]

    def scored(llm) -> tuple[list[tuple[int, float]], int]:
        h = llm.submit(prompt, 6, ignore_eos=True, logprobs=0)
        return [(ev.token, ev.logprob) for ev in h], h.stats.cached_tokens

    with colibri.load(path, ctx_size=400, threads=2) as llm:
        llm._sched.native_prompt = 0  # (a tiny model: make 300 rows "long")
        first, _ = scored(llm)
        llm.save_prompt_cache(cache)
    with colibri.load(path, ctx_size=400, threads=2) as llm:
        llm._sched.native_prompt = 0
        llm.load_prompt_cache(cache)
        again, cached = scored(llm)
    assert cached == len(prompt) - 1 and again == first
