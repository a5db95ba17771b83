"""Speculative decoding (engine/speculative.py): prompt-lookup drafts verified in one step give plain greedy
decoding's tokens, whatever is accepted or rolled back, in a batch, at stops and limits; models it cannot roll
back do not speculate; the gate picks no drafts where they do not pay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import colibri
from colibri.engine import speculative
from colibri.engine.speculative import Acceptance, Lookup, RequestSpec, StepCosts, choose
from colibri.errors import ColibriError
from colibri.kernels import native

REPEAT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200] * 3  # a prompt that repeats itself: lookup proposes at once
N = 40


def _run(llm, prompt=REPEAT, n=N, **kw):
    h = llm.submit(prompt, n, temperature=0, ignore_eos=True, **kw)
    return h.wait(), h


@pytest.mark.parametrize("model_type,scheme", [("mixtral", "f32"), ("olmoe", "f32"), ("qwen3_moe", "f32"),
                                               ("deepseek_v3", "f32"), ("gpt_oss", "f32"), ("olmoe", "int8")])
def test_lookup_gives_plain_tokens(ckpt, model_type, scheme) -> None:
    """MLA latents, attention sinks and a sliding window (gpt-oss's, 8 positions) included; int8 on the native
    kernels, whose plain decoding takes native runs. Drafts are proposed, some accepted, some rejected."""
    if scheme != "f32" and not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    with colibri.load(ckpt.coli(model_type, scheme), ctx_size=128, threads=2) as llm:
        ref, _ = _run(llm, speculative="off")
        got, h = _run(llm, speculative="lookup")
        auto, _ = _run(llm, speculative="auto")
        st, m = h.stats, llm.metrics()
    assert got == ref and auto == ref and len(ref) == N
    assert 0 < st.accepted < st.drafted and st.tokens_per_forward > 1
    assert st.forwards + st.accepted == N - 1  # every token after the prefill's from a forward: its own or a draft
    assert m["spec_drafted"] >= st.drafted and m["spec_accepted"] >= st.accepted and m["tokens_per_forward"] > 1


def _source(monkeypatch, ref: list[int], prompt_len: int, kind: str) -> None:
    """Drafts from plain decoding's own continuation: all right ("accept"), all wrong ("reject"), or right up to
    a depth that cycles through 0..k from one verify to the next ("cycle": every rollback length)."""
    calls = [0]

    def propose(self, k):
        g = len(self.tokens) - prompt_len  # tokens generated, the one to feed included
        true = ref[g : g + k]
        if not true:
            return 0, []
        true += [true[-1]] * (k - len(true))  # (past the reference: anything)
        if kind == "accept":
            return 3, true
        if kind == "reject":
            return 3, [(t + 1) % 300 for t in true]
        calls[0] += 1
        cut = calls[0] % (k + 1)
        return 3, [(t + 1) % 300 if i == cut else t for i, t in enumerate(true)]

    monkeypatch.setattr(Lookup, "propose", propose)


def _own_and_cycled(llm, monkeypatch) -> tuple:
    """Lookup's own drafts on REPEAT, then drafts right up to a depth that cycles through every rollback length on
    another prompt: (their handles, whether both gave plain decoding's tokens)."""
    prompt = [1, 88, 5, 61, 230, 12, 9]
    ref, _ = _run(llm, speculative="off")
    got, h = _run(llm, speculative="lookup")
    plain, _ = _run(llm, prompt, speculative="off")
    with monkeypatch.context() as mp:
        _source(mp, plain, len(prompt), "cycle")
        cyc, hc = _run(llm, prompt, speculative="lookup")
    return h, hc, got == ref and cyc == plain


@pytest.mark.parametrize("kind,scheme", [("accept", "f32"), ("reject", "f32"), ("cycle", "f32"), ("cycle", "int8")])
def test_forced_drafts_roll_back_to_plain_tokens(ckpt, monkeypatch, kind, scheme) -> None:
    """Whatever the drafts, the tokens are plain decoding's (int8: on the native kernels); the slot's record holds
    only the positions fed (the rejected rows' K/V are past it), so the next request reuses the slot's prefix and
    continues as plain."""
    if scheme != "f32" and not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    prompt = [1, 88, 5, 61, 230, 12, 9]
    with colibri.load(ckpt.coli("olmoe", scheme), ctx_size=96, threads=2, slots=1) as llm:
        ref, _ = _run(llm, prompt, speculative="off")
        with monkeypatch.context() as mp:
            _source(mp, ref, len(prompt), kind)
            got, h = _run(llm, prompt, speculative="lookup")
            assert llm.slots.tokens[0] == prompt + ref[:-1]
            more, h2 = _run(llm, prompt + ref[:20], 12, speculative="lookup")
    st = h.stats
    assert got == ref and more == ref[20:32] and h2.stats.cached_tokens == len(prompt) + 19
    assert st.drafted > 0 and st.forwards + st.accepted == N - 1
    if kind == "accept":
        assert st.accepted == st.drafted and st.tokens_per_forward > 4
    elif kind == "reject":
        assert st.accepted == 0 and st.tokens_per_forward == 1
    else:
        assert 0 < st.accepted < st.drafted


def test_staggered_batch_with_drafts_matches_solo(ckpt) -> None:
    """Two requests, the second joining while the first verifies drafts (its prefill steps draft nothing): each
    gets its solo tokens; a plain request beside them too."""
    prompts = [REPEAT, [1, 230, 12, 9, 77, 41, 130, 2, 66] * 2, [1, 88, 5, 61]]
    with colibri.load(ckpt.coli("qwen3_moe", "f32"), ctx_size=128, threads=2, slots=3) as llm:
        hs, solo = _staggered(llm, prompts, ("lookup", "lookup", "off"))
        assert [h.wait() for h in hs] == solo
    assert all(h.stats.drafted > 0 for h in hs[:2]) and hs[2].stats.drafted == 0


def _staggered(llm, prompts: list[list[int]], modes) -> tuple[list, list[list[int]]]:
    """Each prompt's plain tokens alone, then the prompts submitted with their modes, the next one once this one
    gave 3 tokens (it joins requests that decode): (their handles, the plain tokens)."""
    solo = [_run(llm, p, speculative="off")[0] for p in prompts]
    hs = []
    for p, mode in zip(prompts, modes):
        hs.append(llm.submit(p, N, temperature=0, ignore_eos=True, speculative=mode))
        it = iter(hs[-1])
        for _ in range(3):
            next(it)
    return hs, solo


def test_stops_and_limits_inside_an_accepted_run(ckpt, monkeypatch) -> None:
    """A stop id, max_tokens and the context's end met among accepted drafts end the request there, as in plain
    decoding."""
    prompt = [1, 88, 5, 61, 230, 12, 9]
    path = ckpt.coli("olmoe", "f32")
    with colibri.load(path, ctx_size=96, threads=2) as llm:
        ref, _ = _run(llm, prompt, speculative="off")
        j = next(j for j in range(3, N) if ref[j] not in ref[:j])  # the first of its kind
        with monkeypatch.context() as mp:
            _source(mp, ref, len(prompt), "accept")
            got, h = _run(llm, prompt, stop_ids=(ref[j],), speculative="lookup")
            # (plain decoding takes j forwards to meet it; runs of 9 tokens a forward met it inside one)
            assert got == ref[:j] and h.finish_reason == "stop" and h.stats.forwards <= j // 9 + 1
            got, h = _run(llm, prompt, 6, speculative="lookup")
            assert got == ref[:6] and h.finish_reason == "length" and h.stats.accepted == 4
        with monkeypatch.context() as mp:  # a stop as the correction of rejected drafts: the slot keeps what was fed
            _source(mp, ref, len(prompt), "reject")
            got, h = _run(llm, prompt, stop_ids=(ref[j],), speculative="lookup")
            assert got == ref[:j] and h.stats.drafted > 0 and llm.slots.tokens[0] == prompt + ref[:j]
    with colibri.load(path, ctx_size=len(prompt) + 7, threads=2) as llm:
        with monkeypatch.context() as mp:
            _source(mp, ref, len(prompt), "accept")
            got, h = _run(llm, prompt, speculative="lookup")
    assert got == ref[:8] and h.finish_reason == "ctx" and h.stats.accepted > 0


HYBRIDS = ["qwen3_next", "jamba", "nemotron_h", "granitemoehybrid", "kimi_linear", "lfm2_moe", "minimax",
           "bailing_hybrid"]


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrids_roll_their_states_back(ckpt, monkeypatch, model_type) -> None:
    """Recurrent states (gated delta rule, Mamba 1 and 2, KDA, short convolutions, lightning attention): a verify's
    rows take the recurrence one position at a time, the state kept after each, and a rejection restores the state
    after the last row kept. Lookup's own drafts, then drafts right up to a depth that cycles through every
    rollback length (accepted and rejected): plain decoding's tokens."""
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=128, threads=2) as llm:
        h, hc, same = _own_and_cycled(llm, monkeypatch)
    assert same and h.stats.drafted > 0 and 0 < hc.stats.accepted < hc.stats.drafted


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_verifies_to_plain_tokens(ckpt, monkeypatch, model_type) -> None:
    """A sparse attention past its 8 kept positions (GLM-5's shared layers reusing a selection included): a
    verify's rows select what one decode row selects, tied scores included (several rows of the run tie and are
    redone alone), so lookup's own drafts and drafts cut at every depth give plain decoding's tokens."""
    from colibri.models.deepseek_v32 import DSAttention

    redone, top = [0], DSAttention._top

    def counted(self, index, start):
        got = top(self, index, start)
        if start and index.shape[0] > 1:  # a verify: count its rows whose own topk differs from the batched one
            redone[0] += int((got.sort().values != index.topk(self.topk, -1).indices.sort().values).any(-1).sum())
        return got

    monkeypatch.setattr(DSAttention, "_top", counted)
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=128, threads=2) as llm:
        h, hc, same = _own_and_cycled(llm, monkeypatch)
    assert same and h.stats.drafted > 0 and 0 < hc.stats.accepted < hc.stats.drafted
    assert redone[0] > 0


def test_sparse_selection_breaks_ties_as_one_row() -> None:
    """`DSAttention._top` over a verify's rows [n, S] (-inf after each row's own position) picks for every row what
    the same scores give as one decode row [1, S_i]; a prompt from position 0 keeps the batched topk."""
    from colibri.models.deepseek_v32 import DSAttention

    sel = DSAttention.__new__(DSAttention)
    sel.topk = 8
    g = torch.Generator().manual_seed(0)
    differs = 0
    for _ in range(50):
        start, n = int(torch.randint(9, 30, (1,), generator=g)), 5
        S = start + n
        index = torch.relu(torch.randn(n, S, generator=g)).round(decimals=1)  # ties: zeros and equal tenths
        future = torch.arange(S)[None] > torch.arange(start, S)[:, None]
        index = index.masked_fill(future, float("-inf"))
        got = sel._top(index, start).sort().values
        for i in range(n):
            row = index[i, :start + i + 1].contiguous()[None]  # (one decode row's scores: its positions only)
            assert torch.equal(got[i], row.topk(8, -1).indices[0].sort().values)
        differs += int((got != index.topk(8, -1).indices.sort().values).any())
    assert differs > 0  # (the batched form would have picked otherwise: the ties were there)
    assert torch.equal(sel._top(index, 0), index.topk(8, -1).indices)


def test_streamed_experts_draft_only_when_asked(ckpt) -> None:
    """Experts read from disk: "auto" does not draft (its row costs do not model the reads yet), "lookup" does,
    with plain tokens."""
    from colibri.format.container import Container
    from colibri.store import Placement, model_sizes

    path = ckpt.coli("olmoe", "f32")
    with Container(path) as c:
        n_layers = model_sizes(c).n_layers
    with colibri.load(path, ctx_size=128, threads=2, placement=Placement(["disk"] * n_layers)) as llm:
        ref, _ = _run(llm, speculative="off")
        auto, ha = _run(llm, speculative="auto")
        got, h = _run(llm, speculative="lookup")
    assert auto == got == ref and ha.stats.drafted == 0 and 0 < h.stats.accepted < h.stats.drafted


@pytest.mark.parametrize("model_type,scheme", [("olmoe", "int8"), ("mixtral", "int4"), ("gpt_oss", "int8")])
def test_streamed_native_verify_gives_plain_tokens(ckpt, monkeypatch, model_type, scheme) -> None:
    """Experts streamed through a small cache at int8/int4 (the native whole step waiting for its reads): lookup's
    own drafts and drafts right up to a cycling depth give plain tokens, verify rows fetching their experts."""
    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    budget = "600K" if model_type == "gpt_oss" else "300K"
    with colibri.load(ckpt.coli(model_type, scheme), ctx_size=128, threads=2, mem_budget=budget) as llm:
        assert llm.plan.native_layers().cached  # (the setting under test: layers whose experts stream)
        h, hc, same = _own_and_cycled(llm, monkeypatch)
    assert same and h.stats.drafted > 0 and 0 < hc.stats.accepted < hc.stats.drafted


def test_requests_that_do_not_speculate(ckpt) -> None:
    """Processors, log-probs and a bad mode: no drafts, or a one-line refusal (sampled requests do speculate:
    tests/test_spec_sampling.py)."""
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=128, threads=2) as llm:
        for kw in ({"temperature": 0.7, "seed": 1, "repeat_penalty": 1.2}, {"repeat_penalty": 1.2}, {"logprobs": 1}):
            h = llm.submit(REPEAT, 16, ignore_eos=True, speculative="lookup", **{"temperature": 0, **kw})
            h.wait()
            assert h.stats.drafted == 0, kw
        for mode, msg in (("mtp", "needs the model's multi-token-prediction layer"), ("draft", "needs a draft model"),
                          ("fast", "must be one of")):
            with pytest.raises(ColibriError, match=msg):
                llm.submit(REPEAT, 4, speculative=mode)
        with pytest.raises(ColibriError, match="draft_max"):
            llm.submit(REPEAT, 4, draft_max=64)
        llm.speculative = "off"  # the engine's default (--spec): requests that do not say
        assert _run(llm, n=16)[1].stats.drafted == 0


@pytest.mark.default_spec
def test_auto_is_the_default(ckpt, monkeypatch) -> None:
    """Requests that do not say take "auto" (the engine's and the CLI's default without a draft model): on a prompt
    that repeats, with every depth paying, they draft, and give plain tokens; `--spec off` turns it off."""
    import argparse

    from colibri.api import Engine
    from colibri.cli.specflags import apply_spec_args

    assert Engine.speculative == "auto"
    monkeypatch.setattr(speculative, "choose", lambda gains, *_: [len(g) for g in gains])
    monkeypatch.setattr(speculative.Speculator, "hopeless", lambda *_: False)
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=128, threads=2) as llm:
        apply_spec_args(llm, argparse.Namespace(spec=None))
        assert llm.speculative == "auto"
        got, h = _run(llm)
        apply_spec_args(llm, argparse.Namespace(spec="off"))
        ref, h0 = _run(llm)
    assert got == ref and h.stats.drafted > 0 and h0.stats.drafted == 0


def test_lookup_index() -> None:
    """The longest n-gram ending the context, its most recent earlier occurrence, the copy running on over its own
    output; the index kept up to date token by token is the index built at once."""
    lk = Lookup([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2])
    assert lk.propose(3) == (2, [4, 7, 1])  # (1, 2) last seen before 4
    lk.extend([4])
    assert lk.propose(4) == (3, [7, 1, 2, 4])  # (1, 2, 4)
    assert Lookup([6, 6]).propose(5) == (1, [6, 6, 6, 6, 6])  # one period back: the period goes on
    assert Lookup([1, 2, 3]).propose(4) == (0, [])
    digits = [int(c) for c in "31415926535897932384626433832795028841971693993751"]
    inc = Lookup(digits[:2])
    for t in digits[2:]:
        inc.extend([t])
    bulk = Lookup(digits[:20])  # (a prompt: indexed at once)
    bulk.extend(digits[20:])
    assert inc.index == bulk.index and inc.propose(4) == bulk.propose(4) == (1, [6, 9, 3, 9])  # ...1 6 9 3 9 9 3 7 5 1


def test_replayed_acceptance_counts() -> None:
    """Every generated token replays the lookup: the drafts proposed there against the tokens that came."""
    spec = RequestSpec("auto", 3, [1, 2, 3, 1, 2])
    engine = Acceptance()
    spec.sync([3, 1, 2, 9], engine)  # after 3: (1, 2, 3) proposes 1 2 3; 1 and 2 came, then 9
    assert spec.counts.seen[3, :3].tolist() == [1, 1, 1] and spec.counts.ok[3, :3].tolist() == [1, 1, 0]
    spec.sync([3, 1, 2, 9, 1, 2, 3], engine)  # after 9: no match; after 1: (1,) proposes 2 9 1; 2 came, then 3
    assert spec.counts.seen[1, :3].tolist() == [1, 1, 0] and spec.counts.ok[1, :3].tolist() == [1, 0, 0]
    assert (engine.seen == spec.counts.seen).all() and (engine.ok == spec.counts.ok).all()
    assert spec.shadow == (3, [1, 2, 9], 0)  # after 3: (1, 2, 3) last seen before 1 2 9


def test_the_gate() -> None:
    """Injected figures: acceptance measured at 0 gives no drafts even when rows are nearly free; high acceptance
    and cheap rows give the depth that maximizes tokens per second; rows that cost as much as plain steps give
    none; the row cap holds."""
    spec, engine = RequestSpec("auto", 8, [1]), Acceptance()
    engine.seen[3, :8], engine.ok[3, :8] = 1000, 0
    zero = spec.gains(engine, 3, 8)
    assert zero.max() < 0.01
    flat = StepCosts()
    for r in range(2, 10):
        flat.observe(r, 0.0101)
    assert choose([zero], 1, 1.0, flat.estimate(1, 0.01), 64) == [0]
    assert choose([np.zeros(8)], 1, 1.0, StepCosts().estimate(1, 0.01), 64) == [0]  # a tie keeps the plain step

    engine.ok[3, :8] = 900
    high = spec.gains(engine, 3, 8)
    cheap = StepCosts()
    for r in range(2, 10):
        cheap.observe(r, 0.01 * (1 + 0.05 * (r - 1)))
    assert choose([high], 1, 1.0, cheap.estimate(1, 0.01), 64) == [8]
    dear = StepCosts()
    for r in range(2, 10):
        dear.observe(r, 0.01 * r)
    assert choose([high], 1, 1.0, dear.estimate(1, 0.01), 64) == [0]
    steep = StepCosts()  # cheap up to 3 rows, then dear: 2 drafts
    for r, s in ((2, 0.0105), (3, 0.011), (5, 0.03), (9, 0.08)):
        steep.observe(r, s)
    assert choose([high], 1, 1.0, steep.estimate(1, 0.01), 64) == [2]
    assert sum(choose([high, high], 60, 60.0, cheap.estimate(60, 0.01), 64)) == 4  # the cap: 64 rows
    own = RequestSpec("auto", 8, [1])  # a request's own counts, once it has enough, over the engine's
    own.counts.seen[3, :8] = speculative.OWN_SEEN
    assert own.gains(engine, 3, 8).max() < 0.1 < high.min()


def test_auto_skips_the_lookup_where_no_depth_could_pay() -> None:
    """`Speculator.hopeless`: every verify of up to k more rows slower per token than the plain step even with all
    drafts kept (a small model in RAM); not while a row count is unmeasured (the gate explores it first), nor where
    a measured depth could pay."""
    sp = speculative.Speculator(True, False, 64)
    assert not sp.hopeless(1, None, 8) and not sp.hopeless(1, 0.01, 8)  # (nothing measured)
    for r in range(2, 10):
        sp.costs.observe(r, 0.01 * r * 1.1)  # each row dearer than a plain step
    assert sp.hopeless(1, 0.01, 8)
    assert not sp.hopeless(1, 0.01, 12)  # (10+ rows unmeasured: estimated as 9's, optimistic)
    sp.costs.observe(9, 0.05)  # 9 tokens in 5 plain steps' time
    assert not sp.hopeless(1, 0.01, 8)


def test_step_costs_estimate() -> None:
    c = StepCosts()
    est = c.estimate(1, 1.0)
    assert est(1) == 1.0 and est(9) == 1.0  # nothing measured: as the plain step (its first picks explore)
    c.observe(5, 2.0)
    c.observe(5, 4.0)  # EWMA
    est = c.estimate(1, 1.0)
    assert est(5) == 2.5 and est(3) == pytest.approx(1.75) and est(9) == 2.5


def test_cli_flags(capsys) -> None:
    from colibri.cli.run import run_parser
    from colibri.cli.serve import serve_parser
    from colibri.cli.specflags import spec_mode

    a = run_parser().parse_args(["--spec", "lookup", "--draft-max", "4", "-p", "x"])
    assert (a.spec, a.draft_max) == ("lookup", 4)
    assert spec_mode(serve_parser().parse_args([])) is None  # (the engine's default: "auto")
    a = serve_parser().parse_args(["--draft-model", "d.coli", "--draft-p-min", "0.3"])
    assert spec_mode(a) == "draft" and a.draft_p_min == 0.3
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--draft-p-min", "2"])
    assert "probability" in capsys.readouterr().err
    assert run_parser().parse_args(["--spec", "mtp"]).spec == "mtp"  # (loads the MTP layer: test_spec_mtp.py)
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--spec", "fast"])
    assert "must be one of" in capsys.readouterr().err


def test_server_field_timings_and_metrics(server) -> None:
    """A completion's `speculative` field, llama-server's draft timings, the refusal of a source not loaded, and
    /metrics' acceptance and tokens per forward."""
    from chat_server import AUTH

    body = {"prompt": REPEAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, off = server.request("POST", "/v1/completions", {**body, "speculative": "off"}, AUTH)
    status2, on = server.request("POST", "/v1/completions", {**body, "speculative": "lookup"}, AUTH)
    assert status == status2 == 200 and on["choices"][0]["text"] == off["choices"][0]["text"]
    assert "draft_n" not in off["timings"] and 0 < on["timings"]["draft_n_accepted"] < on["timings"]["draft_n"]
    status, err = server.request("POST", "/v1/completions", {**body, "speculative": "mtp"}, AUTH)
    assert status == 400 and "multi-token-prediction layer loaded" in err["error"]["message"]
    metrics = server.request("GET", "/metrics")[1]
    drafted = next(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("colibri_spec_draft_tokens"))
    tpf = next(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("colibri_tokens_per_forward"))
    assert drafted >= on["timings"]["draft_n"] and tpf > 1
