"""Sampler, repetition penalty, streaming text, KV cache sizing, EOS and the Python API."""

from __future__ import annotations

import pytest
import torch

import colibri
from colibri.engine.sampling import apply_repetition_penalty, kept, make_sampler
from colibri.errors import ColibriError
from colibri.kernels import native, native_sample
from colibri.tokenizer import StreamDecoder


def test_greedy_sampler_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert make_sampler(0.0)(logits) == 1
    # torch.argmax's choices where numpy's could differ: the first of tied maxima, a NaN, a strided row
    greedy = make_sampler(0.0)
    for row in (torch.tensor([3.0, 1.0, 3.0]), torch.tensor([1.0, float("nan"), 5.0]),
                torch.tensor([-float("inf")] * 4), torch.randn(4, 50304)[:, 7], torch.randn(50304)):
        assert greedy(row) == int(torch.argmax(row))


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    s = make_sampler(5.0, top_k=1, generator=torch.Generator().manual_seed(1))
    assert {s(logits) for _ in range(20)} == {int(logits.argmax())}


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0, -10.0])
    g = torch.Generator().manual_seed(0)
    assert {make_sampler(1.0, top_k=2, generator=g)(logits) for _ in range(200)} == {0, 1}
    # probs ~ [0.665, 0.245, 0.090, ...]: top_p 0.8 keeps the first two tokens only
    assert {make_sampler(1.0, top_p=0.8, generator=g)(logits) for _ in range(200)} == {0, 1}
    assert {make_sampler(1.0, top_p=0.5, generator=g)(logits) for _ in range(50)} == {0}
    # min_p: 0.3 x 0.665 = 0.20 keeps the first two; 0.5 x 0.665 = 0.33 the first only
    assert {make_sampler(1.0, generator=g, min_p=0.3)(logits) for _ in range(200)} == {0, 1}
    assert {make_sampler(1.0, generator=g, min_p=0.5)(logits) for _ in range(50)} == {0}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = torch.Generator().manual_seed(3)
    s = make_sampler(1.0, generator=g)
    counts = torch.bincount(torch.tensor([s(logits) for _ in range(3000)]), minlength=3).float() / 3000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def _reference_kept(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """The cuts as a full sort computes them: {token: probability} of the tokens that may be picked."""
    order = torch.argsort(z.double(), descending=True)
    p = torch.softmax(z.double()[order], 0)
    if top_k:
        order, p = order[:top_k], p[:top_k] / p[:top_k].sum()
    n = len(p)
    if top_p < 1.0:
        n = 1 + int((torch.cumsum(p, 0)[:-1] < top_p).sum())
    if min_p > 0.0:
        n = min(n, int((p >= min_p * p[0]).sum()))
    q = p[:n] / p[:n].sum()
    return dict(zip(order[:n].tolist(), q.tolist()))


@pytest.mark.parametrize("V", [50, 5000, 40000])
def test_kept_tokens_match_a_full_sort(V):
    """The sampler's candidates (a top-64, grown as needed) keep exactly what sorting the whole vocabulary
    keeps, with the same probabilities: peaked and flat rows, masked tokens, every cut and mix of cuts."""
    g = torch.Generator().manual_seed(V)
    for scale in (0.5, 3.0, 12.0):  # flat (the nucleus needs thousands of tokens) to peaked
        z = torch.randn(V, generator=g) * scale
        z[torch.randperm(V, generator=g)[: V // 10]] = float("-inf")  # a grammar's or a bias's bans
        for top_k, top_p, min_p in [(0, 0.9, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.05), (40, 1.0, 0.0), (40, 0.95, 0.05),
                                    (0, 0.95, 0.01), (7, 0.6, 0.0), (0, 0.999, 0.0)]:
            want = _reference_kept(z, top_k, top_p, min_p)
            ids, p = kept(z.clone(), top_k, top_p, min_p)
            assert ids is not None
            got = dict(zip(ids.tolist(), (p.double() / p.double().sum()).tolist()))
            # the same set, but for rounding at the very edge of a cut (f32 vs the reference's f64 sums)
            edge = set(got) ^ set(want)
            assert len(edge) <= 3 and sum(want.get(i, got.get(i)) for i in edge) < 1e-4, (scale, top_k, top_p, min_p)
            assert all(abs(got[i] - want[i]) < 1e-4 for i in set(got) & set(want))
    ids, w = kept(torch.zeros(V))  # temperature alone: every token, in vocabulary order
    assert ids is None and w.shape == (V,)


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable (no compiler or no AVX-512)")
@pytest.mark.parametrize("V", [50, 5000, 40000])
def test_native_sampler_picks_what_the_rule_picks(V):
    """kernels/sample.c (every sampled pick where the kernels load) against the rule in Python (`kept`, the
    inverse CDF at the same uniform): the same token for every u but where u falls within rounding of the
    boundary between two tokens' spans."""
    g = torch.Generator().manual_seed(V + 1)
    us = torch.rand(400, dtype=torch.float64, generator=g).tolist()
    for scale in (0.5, 3.0, 12.0):
        x = torch.randn(V, generator=g) * scale
        x[torch.randperm(V, generator=g)[: V // 10]] = float("-inf")
        for t, top_k, top_p, min_p in [(0.8, 0, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (0.7, 0, 1.0, 0.05),
                                       (0.8, 40, 1.0, 0.0), (0.8, 40, 0.95, 0.05), (1.0, 0, 0.95, 0.01),
                                       (0.5, 7, 0.6, 0.0)]:
            ids, p = kept(x / t, top_k, top_p, min_p)
            ids = torch.arange(V) if ids is None else ids
            cum = torch.cumsum(p.double(), 0) / p.double().sum()
            off = 0
            for u in us:
                want = int(ids[min(int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64),
                                                          right=True)), len(ids) - 1)])
                if native_sample.sample(x, t, top_k, top_p, min_p, u) != want:
                    assert float((cum - u).abs().min()) < 5e-5, (scale, t, top_k, top_p, min_p, u)
                    off += 1
            assert off <= len(us) // 50, (scale, t, top_k, top_p, min_p, off)
    with pytest.raises(ValueError, match="cannot sample"):
        native_sample.sample(torch.full((V,), float("-inf")), 1.0, 0, 0.9, 0.0, 0.5)


def test_long_rows_are_drawn_by_blocks_with_the_right_frequencies():
    """Rows past 4096 tokens are drawn through block sums (sampling._draw): the frequencies still follow
    the distribution, across blocks and inside the last, partial one."""
    V = 20_000
    p = torch.full((V,), 0.3 / (V - 4))  # a flat tail holding 0.3
    heavy = {17: 0.3, 5000: 0.2, 13_000: 0.1, V - 1: 0.1}  # in different blocks; the last in the partial one
    for i, v in heavy.items():
        p[i] = v
    s = make_sampler(1.0, generator=torch.Generator().manual_seed(5))
    picks = torch.tensor([s(p.log()) for _ in range(4000)])
    for i, v in heavy.items():
        assert abs(float((picks == i).float().mean()) - v) < 0.03, i
    assert abs(float((~torch.isin(picks, torch.tensor(list(heavy)))).float().mean()) - 0.3) < 0.03


def test_sampling_impossible_rows_raise():
    s = make_sampler(1.0, top_p=0.9, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cannot sample"):
        s(torch.full((10,), float("nan")))


def test_a_requests_uniforms_are_a_stream_by_token_index():
    """engine/sampling.stream: token j's uniform is the same taken alone or among a run's, in [0, 1),
    spread evenly, and another seed gives another stream."""
    from colibri.engine.sampling import stream

    run = stream(7, 0, 2000)
    assert run[:50] == [stream(7, j, 1)[0] for j in range(50)] and run[100:120] == stream(7, 100, 20)
    assert all(0.0 <= u < 1.0 for u in run) and abs(sum(run) / len(run) - 0.5) < 0.02
    assert torch.histc(torch.tensor(run), bins=10, min=0, max=1).min() > 150  # ~200 a tenth
    assert stream(8, 0, 50) != run[:50] and stream(2**63 - 1, 0, 3) != stream(0, 0, 3)


def test_repetition_penalty_matches_transformers_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # input untouched


def test_repetition_penalty_window_is_the_last_n_tokens():
    """repeat_last_n: the penalty sees the last n of prompt + generated tokens (llama.cpp's and Ollama's
    window), -1 all of them (the default), 0 none; it slides as tokens are generated."""
    from colibri.engine.request import SamplingParams
    from colibri.engine.sampling import TokenPicker

    logits = torch.full((8,), 2.0)

    def penalized(n: int, generated: list[int]) -> list[int]:
        p = TokenPicker(SamplingParams(repeat_penalty=2.0, repeat_last_n=n).validate(), [1, 2, 3])
        for t in generated:
            p.took(t)
        return [i for i, v in enumerate(p.processed(logits).tolist()) if v != 2.0]

    assert penalized(-1, [5]) == [1, 2, 3, 5]
    assert penalized(2, []) == [2, 3] and penalized(2, [5]) == [3, 5] and penalized(2, [5, 6]) == [5, 6]
    assert penalized(0, [5]) == []
    assert TokenPicker(SamplingParams(repeat_penalty=2.0, repeat_last_n=0), [1]).run_spec is not None
    with pytest.raises(ColibriError, match="repeat_last_n"):
        SamplingParams(repeat_last_n=-2).validate()


def test_stream_decoder_holds_back_partial_utf8(ckpt):
    llm = colibri.load(ckpt.coli("mixtral", "f32"), ctx_size=32)
    text = "naïve café — 東京 🙂 ok"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    dec = StreamDecoder(llm.tokenizer)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == llm.tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_kv_cache_is_preallocated_in_proportion_to_ctx(ckpt):
    small = colibri.load(ckpt.coli("qwen3_moe", "f32"), ctx_size=64)
    large = colibri.load(ckpt.coli("qwen3_moe", "f32"), ctx_size=256)
    assert small.kv_bytes() > 0 and large.kv_bytes() == 4 * small.kv_bytes()


def test_generation_stops_at_eos(ckpt):
    llm = colibri.load(ckpt.coli("mixtral", "f32"), ctx_size=128)
    prompt = [1, 17, 42, 99]
    free = list(llm.generate_ids(prompt, 20, ignore_eos=True))
    eos = free[5]  # pretend the 6th greedy token is end-of-sequence
    llm.tokenizer.eos_ids = {eos}
    stopped = list(llm.generate_ids(prompt, 20))
    assert stopped == free[: free.index(eos)]  # EOS ends the stream; it is not a generated token
    assert llm.last_stats.stop_reason == "stop"
    assert llm.last_stats.generated == len(stopped)


def test_api_logits_are_independent_of_earlier_calls(ckpt):
    llm = colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=1)
    ids = [1, 5, 9, 13, 200, 7]
    first = llm.logits(ids)
    list(llm.generate("Something else entirely", max_tokens=10, temperature=0.7, seed=1))
    assert first.shape == (6, llm.tokenizer.vocab_size) and first.dtype == torch.float32
    assert torch.equal(first, llm.logits(ids))
    # the last position of teacher-forced logits is what greedy decoding picks next
    assert int(first[-1].argmax()) == next(iter(llm.generate_ids(ids, 1)))


def test_api_rejects_bad_settings(ckpt):
    llm = colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=16)
    with pytest.raises(ColibriError, match="top_p"):
        list(llm.generate("x", 4, top_p=0))
    with pytest.raises(ColibriError, match="min_p"):
        list(llm.generate("x", 4, min_p=1.5))
    with pytest.raises(ColibriError, match="does not fit ctx-size"):
        llm.logits(list(range(1, 20)))


def test_logit_bias_moves_the_choice_not_the_logprobs(ckpt):
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=1) as llm:
        ids = [1, 5, 9, 13]
        logits = llm.logits(ids)[-1]  # [V]
        best, second = logits.topk(2).indices.tolist()
        assert list(llm.generate_ids(ids, 1, logit_bias={best: -100})) == [second]
        low = int(logits.argmin())
        assert list(llm.generate_ids(ids, 1, logit_bias={low: 100.0, best: -5})) == [low]
        h = llm.submit(ids, 1, logit_bias={low: 100}, logprobs=1)
        ev = next(iter(h))
        logp = torch.log_softmax(logits, -1)
        assert ev.token == low and ev.logprob == pytest.approx(float(logp[low]), abs=1e-5)
        assert ev.top[0][0] == best  # alternatives: the model's own ranking
        sampled = [list(llm.generate_ids(ids, 4, temperature=1.0, seed=s, logit_bias={low: 100})) for s in range(3)]
        assert all(t[0] == low for t in sampled)
        for bad in ({-1: 1.0}, {llm.vocab_rows: 1.0}, {3: 101.0}, {3: float("nan")}, {True: 1.0}, {"3": 1.0}, [3]):
            with pytest.raises(ColibriError, match="logit_bias"):
                llm.submit(ids, 1, logit_bias=bad)


def test_chat_prompt_gets_no_second_bos(ckpt, capsys):
    from colibri.cli import main

    model = ckpt.coli("mixtral", "f32")
    llm = colibri.load(model, ctx_size=128)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(1) == 1  # the template's own <s>
    expected = llm.tokenizer.decode(list(llm.generate_ids(ids, 6, ignore_eos=True)))
    assert main(["-m", str(model), "-p", "Hi there", "--chat", "-n", "6", "--temp", "0", "--ignore-eos",
                 "--no-stats"]) == 0
    assert capsys.readouterr().out == expected + "\n"
