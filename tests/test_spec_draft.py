"""A draft model as the draft source (engine/draft.py): the target's greedy tokens whatever the draft proposes,
on every family that can roll back, in batches with staggered joins and reused slots, sampled requests
reproducible; refusals in one line."""

from __future__ import annotations

import pytest
from test_speculative import _staggered

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native

REPEAT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200]
N = 40


def _run(llm, prompt=REPEAT, n=N, **kw):
    h = llm.submit(prompt, n, temperature=kw.pop("temperature", 0), ignore_eos=True, **kw)
    return h.wait(), h


def _load(target, draft, **kw):
    llm = colibri.load(target, ctx_size=kw.pop("ctx_size", 128), threads=2, draft_model=draft, **kw)
    llm._draft.p_min = 0.0  # (random tiny models are never sure of a token: draft every depth)
    return llm


@pytest.mark.parametrize("model_type,scheme,draft_scheme", [
    ("mixtral", "f32", "int8"), ("olmoe", "f32", "int8"), ("qwen3_moe", "f32", "int8"),
    ("deepseek_v3", "f32", "int8"), ("gpt_oss", "f32", "int8"), ("olmoe", "int8", "f32"),
    ("qwen3_next", "f32", "int8")])
def test_draft_model_gives_plain_tokens(ckpt, model_type, scheme, draft_scheme) -> None:
    """The draft is the same model at another precision: it proposes mostly, not always, the target's tokens;
    "draft" and "auto" (which asks the draft where prompt lookup has no full match) give plain decoding's (a hybrid's
    recurrent states rolled back)."""
    if "int8" in (scheme, draft_scheme) and not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    draft = ckpt.coli("qwen3_moe" if model_type == "qwen3_next" else model_type, draft_scheme)  # (a draft keeps K/V)
    with _load(ckpt.coli(model_type, scheme), draft) as llm:
        ref, _ = _run(llm, speculative="off")
        got, h = _run(llm, speculative="draft")
        auto, _ = _run(llm, speculative="auto")
        forwards = llm._draft.forwards
    st = h.stats
    assert got == ref and auto == ref and len(ref) == N
    assert st.drafted > 0 and st.forwards + st.accepted == N - 1 and forwards > 0
    # acceptance by draft position: what was proposed and kept there, kept ones a prefix of each verify's drafts
    assert sum(st.draft_reached) == st.drafted and sum(st.draft_kept) == st.accepted
    assert all(a >= b for a, b in zip(st.draft_kept, st.draft_kept[1:]))
    if model_type != "qwen3_next":
        assert 0 < st.accepted < st.drafted


@pytest.mark.parametrize("draft_type", ["qwen3", "llama"])
def test_a_dense_draft_model(ckpt, draft_type) -> None:
    """A dense model as the draft (the usual pairing: a small dense sibling), its drafts from native runs at int8."""
    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    with _load(ckpt.coli("qwen3_moe", "int8"), ckpt.coli(draft_type, "int8")) as llm:
        ref, _ = _run(llm, speculative="off")
        got, h = _run(llm, speculative="draft")
    assert got == ref and h.stats.drafted > 0


def test_a_wrong_draft_and_staggered_joins(ckpt) -> None:
    """Another model as the draft (mostly wrong), three requests joining at different steps, one of them plain,
    then a reused slot: every request gets its solo tokens."""
    prompts = [REPEAT * 2, [1, 230, 12, 9, 77, 41, 130, 2, 66], [1, 88, 5, 61]]
    with _load(ckpt.coli("qwen3_moe", "f32"), ckpt.coli("mixtral", "f32"), slots=3) as llm:
        hs, solo = _staggered(llm, prompts, ("draft", "draft", "off"))
        assert [h.wait() for h in hs] == solo
        again, h2 = _run(llm, prompts[1][:5] + [3, 4], speculative="draft")  # a slot another request used
        ref2, _ = _run(llm, prompts[1][:5] + [3, 4], speculative="off")
    assert all(h.stats.drafted > 0 for h in hs[:2]) and hs[2].stats.drafted == 0
    assert again == ref2 and h2.stats.drafted > 0


def test_sampled_requests_with_a_draft_model(ckpt) -> None:
    """A seeded sampled request verifies the draft's proposals with the accept/resample rule: the same text on
    every run (engine/verify.py; its distribution: tests/test_spec_sampling.py)."""
    with _load(ckpt.coli("olmoe", "f32"), ckpt.coli("olmoe", "f32")) as llm:
        a, h = _run(llm, temperature=0.9, seed=4, speculative="draft")
        b, _ = _run(llm, temperature=0.9, seed=4, speculative="draft")
    assert a == b and len(a) == N and h.stats.accepted > 0


def test_the_drafts_confidence_stops_it(ckpt) -> None:
    """With p_min 1.0 no pick is sure enough: nothing is drafted, the tokens are plain."""
    with _load(ckpt.coli("olmoe", "f32"), ckpt.coli("olmoe", "f32")) as llm:
        ref, _ = _run(llm, speculative="off")
        llm._draft.p_min = 1.01
        got, h = _run(llm, speculative="draft")
    assert got == ref and h.stats.drafted == 0


def test_refusals(ckpt) -> None:
    """"draft" without a draft model; a draft whose tokenizer differs (the demo's); a draft with a recurrent state
    (qwen3_next): one line each."""
    from colibri.demo import demo_model

    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=2) as llm:
        with pytest.raises(ColibriError, match="needs a draft model"):
            llm.submit(REPEAT, 4, speculative="draft")
    with pytest.raises(ColibriError, match="tokenizer differs"):
        colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=2, draft_model=demo_model())
    with pytest.raises(ColibriError, match="not a recurrent state"):
        colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=2, draft_model=ckpt.coli("qwen3_next", "f32"))


def test_cli_run_with_a_draft_model(ckpt, capsys) -> None:
    """`colibri run --draft-model` drafts by default (--spec draft) and prints the same text as without; --spec
    draft without a draft model is one line before loading."""
    from colibri.cli.run import main

    target, draft = str(ckpt.coli("olmoe", "f32")), str(ckpt.coli("olmoe", "int8"))
    args = ["-m", target, "-p", "one two three one two three one two", "-n", "24", "--temp", "0", "-t", "2",
            "--ignore-eos", "--stats"]
    main(args + ["--spec", "off"])
    plain = capsys.readouterr()
    main(args + ["--draft-model", draft, "--draft-p-min", "0"])
    spec = capsys.readouterr()
    assert spec.out == plain.out and "drafts " in spec.err and "drafts " not in plain.err
    with pytest.raises(ColibriError, match="needs a draft model"):
        main(args + ["--spec", "draft"])


def test_the_draft_gate() -> None:
    """"auto" asks the draft model while its measured rate beats plain decoding's; unmeasured it is tried; where it
    did not pay it is tried again after RETRY plain steps, then twice as many."""
    from colibri.engine.draft import RETRY, DraftGate

    g = DraftGate()
    assert g.pays(1000.0)  # unmeasured: try it
    g.observe(9, 0.004)  # 2250 tokens/s
    assert g.pays(1000.0) and not g.pays(3000.0)
    assert [g.pays(3000.0) for _ in range(RETRY - 1)] == [False] * (RETRY - 2) + [True]
    assert [g.pays(3000.0) for _ in range(2 * RETRY)] == [False] * (2 * RETRY - 1) + [True]  # (the wait doubles)
    for _ in range(40):
        g.observe(2, 0.004)  # it stopped paying: the EWMA follows
    assert not g.pays(1000.0)


def test_serve_and_generate_wiring(ckpt) -> None:
    """`colibri serve --draft-model` loads the draft and defaults requests to it; `generate(..., speculative=)`
    passes the mode through."""
    from colibri.cli.common import engine_from_args
    from colibri.cli.serve import serve_parser
    from colibri.cli.specflags import apply_spec_args

    a = serve_parser().parse_args(["-m", str(ckpt.coli("olmoe", "f32")), "--draft-model",
                                   str(ckpt.coli("olmoe", "int8")), "--draft-p-min", "0", "--ctx-size", "64",
                                   "-t", "2"])
    llm = engine_from_args(a)
    try:
        apply_spec_args(llm, a)
        assert llm.speculative == "draft" and llm._draft.p_min == 0.0
        text = "".join(llm.generate("one two three", 12, temperature=0, ignore_eos=True))
        st = llm.last_stats
        plain = "".join(llm.generate("one two three", 12, temperature=0, ignore_eos=True, speculative="off"))
        assert text == plain and st.drafted > 0 and llm.last_stats.drafted == 0
    finally:
        llm.close()


def test_a_model_that_cannot_speculate_says_so(ckpt, capsys) -> None:
    """bf16 on torch (no native whole step) verifies otherwise than one row at a time: the run decodes plainly and
    says why in one line."""
    from colibri.cli.run import main

    main(["-m", str(ckpt.coli("olmoe", "bf16")), "--draft-model", str(ckpt.coli("olmoe", "int8")), "-p",
          "one two", "-n", "6", "--temp", "0", "-t", "2", "--ignore-eos"])
    err = capsys.readouterr().err
    assert "--spec draft: this model decodes without drafts: its layers do not run in the native whole step" in err


def test_the_draft_counts_in_the_memory_budget(ckpt) -> None:
    """--mem-budget bounds the weights of both: the target plans with what the draft's weights leave; a draft that
    takes it all is one line."""
    from colibri.format.container import Container
    from colibri.store.sizes import model_sizes

    target, draft = ckpt.coli("olmoe", "int8"), ckpt.coli("olmoe", "int4")
    with Container(draft) as c:
        need = model_sizes(c).total_bytes
    budget = need + 700_000
    with colibri.load(target, ctx_size=64, threads=2, mem_budget=budget, draft_model=draft) as llm:
        assert llm.store.mem_budget == budget - need
        assert _run(llm, n=8, speculative="draft")[0] == _run(llm, n=8, speculative="off")[0]
    with pytest.raises(ColibriError, match="take all of --mem-budget"):
        colibri.load(target, ctx_size=64, threads=2, mem_budget=need, draft_model=draft)


def test_a_draft_at_the_context_end(ckpt) -> None:
    """Drafts stop at the context's last position (the draft's slot and the target's): the request ends "ctx" with
    plain decoding's tokens; and at max_tokens inside an accepted run, "length"."""
    prompt = [1, 88, 5, 61, 230, 12, 9]
    with _load(ckpt.coli("olmoe", "f32"), ckpt.coli("olmoe", "int8"), ctx_size=len(prompt) + 7) as llm:
        ref, hr = _run(llm, prompt, speculative="off")
        got, h = _run(llm, prompt, speculative="draft")
        short, hs = _run(llm, prompt, 3, speculative="draft")
    assert got == ref and len(ref) == 8 and h.finish_reason == hr.finish_reason == "ctx" and h.stats.drafted > 0
    assert short == ref[:3] and hs.finish_reason == "length"
