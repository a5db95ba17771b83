"""A lone greedy request decodes several tokens per native call (engine/runner.py `_run`, kernels/step.c
coli_decode_run): the same tokens, stops, finish reasons and counters as one step per token."""

from __future__ import annotations

import pytest

from colibri.engine import runner
from colibri.kernels import native, native_run

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3, 88, 120, 31, 9]


def _spy_runs(monkeypatch) -> list[int]:
    """Steps per coli_decode_run call, recorded."""
    real, runs = native_run.decode_run, []

    def spy(*a, **kw):
        out = real(*a, **kw)
        runs.append(len(out[0]))
        return out
    monkeypatch.setattr(native_run, "decode_run", spy)
    return runs


def _go(llm, monkeypatch, run_s: float, **kw) -> tuple[list[int], str, dict, list[int]]:
    """(tokens, finish reason, the request's expert counts, steps per native run) with runs of run_s."""
    with monkeypatch.context() as mp:
        mp.setattr(runner, "RUN_S", run_s)
        runs = _spy_runs(mp)
        kw.setdefault("temperature", 0)
        h = llm.submit(kw.pop("prompt", PROMPT), **kw)
        toks = h.wait()
    st = h.stats
    return toks, h.finish_reason, {"own": st.experts_own, "fetched": st.experts_fetched_share,
                                   "generated": st.generated}, runs


@pytest.mark.parametrize("model_type,scheme", [("olmoe", "int4"), ("minimax_m2", "int8")])
def test_native_runs_give_the_tokens_of_single_steps(ckpt, monkeypatch, model_type, scheme) -> None:
    """Runs of up to 40 steps (RUN_S far above a step's time) against one step per token: the same
    tokens and counters; a stop id met inside a run ends the request there with "stop"; max_tokens and a
    full context end it as they do step by step."""
    import colibri

    llm = colibri.load(ckpt.coli(model_type, scheme), ctx_size=64, threads=2, cache_prompt=False)  # (same prefills)
    try:
        before = llm.metrics()
        ref, why, stats, runs = _go(llm, monkeypatch, 0.0, max_tokens=40, ignore_eos=True)
        assert runs == [] and why == "length" and len(ref) == 40
        mid = llm.metrics()
        got, why, stats_run, runs = _go(llm, monkeypatch, 10.0, max_tokens=40, ignore_eos=True)
        after = llm.metrics()
        assert got == ref and why == "length" and stats_run == stats
        # Every token after the prefill's in native runs (the first request's 40 steps timed both thread
        # counts: engine/threads.py keeps its exploring steps single).
        assert runs and sum(runs) == 39 and max(runs) > 1
        for key in ("generated_tokens", "experts_unique", "experts_summed", "decode_rows"):
            assert after[key] - mid[key] == mid[key] - before[key], key

        stop = ref[12]
        first = ref.index(stop)
        for run_s in (0.0, 10.0):
            toks, why, _, runs = _go(llm, monkeypatch, run_s, max_tokens=40, stop_ids=(stop,), ignore_eos=True)
            assert toks == ref[:first] and why == "stop", run_s
            assert bool(runs) == (run_s > 0 and first > 1)

        for run_s in (0.0, 10.0):  # 16 prompt positions of 64: the context fills after 48 generated tokens
            toks, why, _, _ = _go(llm, monkeypatch, run_s, max_tokens=100, ignore_eos=True)
            assert why == "ctx" and len(toks) == 49 and toks[:40] == ref, run_s
    finally:
        llm.close()


def test_log_probs_come_out_of_native_runs_as_out_of_single_steps(ckpt, monkeypatch) -> None:
    """Log-probs (kernels/logprobs.c, which single steps call too) come out of native runs: the same tokens,
    log-probabilities and alternatives, greedy and sampled, with and without processors (whose changes they do
    not see: the model's logits); two greedy requests run together. (A grammar still needs single steps:
    TokenPicker.run_spec.)"""
    import colibri

    llm = colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, slots=2, threads=2, cache_prompt=False)
    try:
        for kw in ({"logprobs": 2}, {"logprobs": 0}, {"temperature": 0.8, "seed": 1, "logprobs": 5,
                                                      "repeat_penalty": 1.3, "logit_bias": {159: -100.0}}):
            got = {}
            for run_s in (0.0, 10.0):
                with monkeypatch.context() as mp:
                    mp.setattr(runner, "RUN_S", run_s)
                    runs = _spy_runs(mp)
                    h = llm.submit(PROMPT, max_tokens=24, ignore_eos=True, **{"temperature": 0, **kw})
                    got[run_s] = [(e.token, e.logprob, e.top) for e in h]
                assert bool(runs) == (run_s > 0), kw
            assert got[0.0] == got[10.0], kw
            assert all(lp is not None and lp <= 0 and len(top) == kw["logprobs"] for _, lp, top in got[0.0])
        ref, _, _, _ = _go(llm, monkeypatch, 0.0, max_tokens=12, ignore_eos=True)
        with monkeypatch.context() as mp:
            mp.setattr(runner, "RUN_S", 10.0)
            runs = _spy_runs(mp)
            hs = [llm.submit(PROMPT, max_tokens=12, ignore_eos=True, temperature=0) for _ in range(2)]
            outs = [h.wait() for h in hs]
        assert outs == [ref, ref]
    finally:
        llm.close()


def test_native_log_probs_are_torchs(ckpt) -> None:
    """kernels/logprobs.c against torch's log_softmax and topk on rows of a real model's logits: within f32
    rounding, the same alternatives in the same order."""
    import torch

    from colibri.engine.sampling import token_logprobs

    g = torch.Generator().manual_seed(0)
    for V in (17, 384, 32000):
        x = torch.randn(V, generator=g) * 4
        tok = int(torch.randint(V, (1,), generator=g))
        lp, top = token_logprobs(x, tok, 5)
        ref = torch.log_softmax(x, -1)
        assert abs(lp - float(ref[tok])) <= 1e-5 * max(1.0, abs(float(ref[tok])))
        v, i = ref.topk(5)
        assert [t for t, _ in top] == i.tolist()
        assert torch.allclose(torch.tensor([p for _, p in top]), v, atol=1e-5, rtol=0)


PROCESSORS = [{"repeat_penalty": 1.5}, {"repeat_penalty": 1.5, "repeat_last_n": 4},
              {"repeat_penalty": 0.5, "repeat_last_n": -1}, {"logit_bias": {5: 2.0, 159: -100.0, 88: 3.5}},
              {"frequency_penalty": 1.5}, {"presence_penalty": 2.0, "frequency_penalty": -0.5},
              # Ollama's defaults (server/ollama.py), sampled
              {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 64, "seed": 3}]


@pytest.mark.parametrize("kw", PROCESSORS)
def test_logit_processors_run_natively_with_the_tokens_of_single_steps(ckpt, monkeypatch, kw) -> None:
    """A logit bias, the repetition penalty (a window of the last n tokens, the prompt's included, or all of
    them) and the presence / frequency penalties apply in native runs (kernels/procs.c) as step by step
    (engine/sampling.py TokenPicker.processed): the same tokens, which they change."""
    import colibri

    llm = colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, threads=2, cache_prompt=False)
    try:
        plain, _, _, _ = _go(llm, monkeypatch, 0.0, max_tokens=40, ignore_eos=True,
                             **{k: v for k, v in kw.items() if k in ("temperature", "top_k", "top_p", "seed")})
        ref, _, _, runs = _go(llm, monkeypatch, 0.0, max_tokens=40, ignore_eos=True, **kw)
        assert runs == [] and len(ref) == 40 and ref != plain
        got, _, _, runs = _go(llm, monkeypatch, 10.0, max_tokens=40, ignore_eos=True, **kw)
    finally:
        llm.close()
    assert got == ref and runs and max(runs) > 1


def test_runs_wait_until_the_thread_count_is_chosen(ckpt, monkeypatch) -> None:
    """A fresh engine times 1 and 2 decode threads over its first steps (engine/threads.py: EXPLORE + 1
    timings each); those stay single steps, and the runs start after them."""
    import colibri
    from colibri.engine import threads

    llm = colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, threads=2)
    try:
        got, _, _, runs = _go(llm, monkeypatch, 10.0, max_tokens=40, ignore_eos=True)
    finally:
        llm.close()
    assert len(got) == 40 and sum(runs) == 39 - 2 * (threads.EXPLORE + 1)


def test_concurrent_greedy_requests_run_together(ckpt, monkeypatch) -> None:
    """Several plain-greedy requests decode in one native run (a row each): every request gets the tokens,
    finish reason and expert counts it gets with one step at a time, the engine the same batching counts;
    a stop id one of them meets ends the run, that request alone finishes, and the others go on."""
    import colibri

    prompts = [PROMPT, PROMPT[:9], [1, 250, 251, 33, 34, 35, 90, 91, 92, 17]]
    llm = colibri.load(ckpt.coli("olmoe", "int8"), ctx_size=64, slots=3, threads=2, cache_prompt=False)
    shapes: list[int] = []
    real = native_run.decode_run

    def spy(*a, **kw):
        out = real(*a, **kw)
        shapes.append(out[1].shape[2])  # rows of the run
        return out

    def batch(run_s: float, stop: tuple[int, ...] = ()) -> tuple[list, dict]:
        with monkeypatch.context() as mp:
            mp.setattr(runner, "RUN_S", run_s)
            mp.setattr(native_run, "decode_run", spy)
            before = llm.metrics()
            # submitted together: the first admit takes all three, their prompts share the first step
            hs = [llm.submit(p, max_tokens=30, temperature=0, ignore_eos=True, stop_ids=stop) for p in prompts]
            out = [(h.wait(), h.finish_reason, h.stats.experts_own, h.stats.generated) for h in hs]
            after = llm.metrics()
        return out, {k: after[k] - before[k] for k in ("experts_unique", "experts_summed", "generated_tokens")}

    try:
        batch(0.0)  # times the thread counts for 3 rows (their exploring steps stay single)
        ref, ref_counts = batch(0.0)
        got, counts = batch(10.0)
        assert got == ref and counts == ref_counts and max(shapes) == 3
        stop = ref[1][0][5]  # the second request's sixth token
        shapes.clear()
        ref_stop, _ = batch(0.0, (stop,))
        got_stop, _ = batch(10.0, (stop,))
    finally:
        llm.close()
    assert got_stop == ref_stop and ref_stop[1][1] == "stop" and len(ref_stop[1][0]) <= 5
    assert any(n == 3 for n in shapes)


def test_decode_run_ms_sets_the_run_length(ckpt, monkeypatch) -> None:
    """`decode_run_ms=0` hands out every token as it is made (no native run); a bad value is refused by name."""
    import colibri
    from colibri.errors import ColibriError

    for bad in (-1, float("nan"), "20", True):
        with pytest.raises(ColibriError, match="decode_run_ms"):
            colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, decode_run_ms=bad)
    for ms, runs_expected in ((0, False), (50, True)):
        llm = colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, threads=2, decode_run_ms=ms)
        try:
            with monkeypatch.context() as mp:
                runs = _spy_runs(mp)
                assert len(llm.submit(PROMPT, max_tokens=30, ignore_eos=True, temperature=0).wait()) == 30
        finally:
            llm.close()
        assert bool(runs) == runs_expected, ms


def test_sampled_requests_run_natively_with_the_tokens_of_single_steps(ckpt, monkeypatch) -> None:
    """Sampling without processors takes native runs (kernels/sample.c picks in C with the uniforms of the
    request's next tokens, engine/sampling.stream): each seeded request gets the tokens it gets one step at
    a time, alone and beside others (greedy and sampled rows in one run), with every cut, and a stop met
    inside a run ends it there."""
    import colibri

    # (this random model's distributions are sharp: high temperatures make the cuts matter)
    settings = [{"temperature": 4.0, "seed": 3}, {"temperature": 5.0, "top_k": 20, "seed": 4},
                {"temperature": 4.0, "top_p": 0.9, "min_p": 0.02, "seed": 5}, {"temperature": 0.0}]
    llm = colibri.load(ckpt.coli("olmoe", "int8"), ctx_size=64, slots=4, threads=2, cache_prompt=False)

    def go(run_s: float, together: bool, stop: tuple[int, ...] = ()) -> tuple[list, list[int]]:
        with monkeypatch.context() as mp:
            mp.setattr(runner, "RUN_S", run_s)
            runs = _spy_runs(mp)
            if together:
                hs = [llm.submit(PROMPT, max_tokens=30, ignore_eos=True, stop_ids=stop, **kw) for kw in settings]
                out = [(h.wait(), h.finish_reason) for h in hs]
            else:
                out = [(h.wait(), h.finish_reason) for h in
                       (llm.submit(PROMPT, max_tokens=30, ignore_eos=True, stop_ids=stop, **kw) for kw in settings)]
        return out, runs

    try:
        go(0.0, True)  # times the thread counts for 4 rows and for 1 (their exploring steps stay single)
        go(0.0, False)
        ref, runs = go(0.0, False)
        assert runs == [] and all(why == "length" and len(t) == 30 for t, why in ref)
        assert len({tuple(t) for t, _ in ref}) == 4  # the settings give four different texts
        for together in (False, True):
            got, runs = go(10.0, together)
            assert got == ref and runs and max(runs) > 1, together
        stop = ref[2][0][10]
        first = ref[2][0].index(stop)
        got, runs = go(10.0, False, (stop,))
        assert got[2] == (ref[2][0][:first], "stop") and runs
    finally:
        llm.close()


def test_rows_with_and_without_processors_share_a_run(ckpt, monkeypatch) -> None:
    """Two greedy requests, one with penalties and a bias, one plain, decode in the same native runs (a
    row without processors has none applied) with the tokens each gets one step at a time."""
    import colibri

    kws = [{"repeat_penalty": 1.5, "repeat_last_n": 8, "frequency_penalty": 0.5, "logit_bias": {159: -100.0}}, {}]
    llm = colibri.load(ckpt.coli("olmoe", "int4"), ctx_size=64, slots=2, threads=2, cache_prompt=False)
    rows: list[int] = []
    real = native_run.decode_run

    def spy(*a, **kw):
        out = real(*a, **kw)
        rows.append(out[1].shape[2])
        return out

    def both(run_s: float) -> list[list[int]]:
        with monkeypatch.context() as mp:
            mp.setattr(runner, "RUN_S", run_s)
            mp.setattr(native_run, "decode_run", spy)
            hs = [llm.submit(PROMPT, max_tokens=30, temperature=0, ignore_eos=True, **kw) for kw in kws]
            return [h.wait() for h in hs]

    try:
        both(0.0)  # (the thread counts timed for two rows)
        ref = both(0.0)
        got = both(10.0)
    finally:
        llm.close()
    assert got == ref and ref[0] != ref[1] and 2 in rows
