"""Speculative decoding on the demo model: every draft source against plain decoding, in the same run.

    .venv/bin/python benchmarks/bench_spec.py [--tokens 200] [--tokens-ram 800] [--repeats 3] [--repeats-ram 9]
                                              [--threads 2]
                                              [--mem-budget 2M] [--skip-streamed] [--synth PATH.coli]

The target is the shipped demo model (colibri/data/demo, a trained 4-layer Mixtral-style MoE) with its multi-token-
prediction layer (colibri/data/demo-mtp, one more Mixtral layer trained on the same stories to predict the token
after next by tools/make_demo_mtp.py), its draft the shipped demo draft (colibri/data/demo-draft, a 0.13 M-parameter
dense Qwen3 trained on the same stories by tools/make_draft_model.py). Three prompts (fixed, from the stories the
demo learnt: tools/make_demo_model.py): a rewrite that repeats its input (a story, then the instruction to tell it
again and its first words), a summary that quotes (a story, then a sentence of it to go on from), and free story
text. Two settings: in RAM (int8), and with the experts streamed from the container under --mem-budget (each token's
misses read from the file, through the page cache; --mem-budget is the target's own: the draft's and the MTP layer's
weights are added to what the engine is given, since it takes them out).
For each (setting, prompt, source: off, lookup, auto, draft, mtp): decode tok/s (the median of --repeats runs, the
sources alternated run by run), the ratio to off, tokens per forward, acceptance by draft position, and whether the
text equals off's (greedy: it must).
`--synth M.coli` adds a random-init model (e.g. the 0.44B OLMoE shape of benchmarks/synth_ckpt.py, converted int8):
what "auto" decides there and why (its verify-step cost table and lookup acceptance).

The load average is printed with every table: these machines have 2 cores, and a figure taken beside other work
is noise. No peer runs here: the question is what each source gains over the same engine's plain decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colibri  # noqa: E402
from colibri.demo import demo_model  # noqa: E402
from colibri.format.container import Container  # noqa: E402
from colibri.store.placement import parse_size  # noqa: E402
from colibri.store.sizes import model_sizes, mtp_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from make_demo_model import make_corpus  # noqa: E402 - the stories the demo model learnt (seeded, fixed)

_DOCS = make_corpus().split("\n\n")
PROMPTS = {
    # a rewrite that repeats its input: a story, then the instruction to tell it again and its first words
    "edit": f"{_DOCS[1]}\n\nNow tell the same story again.\n\n{' '.join(_DOCS[1].split()[:10])}",
    # a summary that quotes: a story, then a sentence of it to go on from
    "quote": f"{_DOCS[2]}\n\nThe story says: On the way home,",
    "story": "Once upon a time",  # free story text
}
SOURCES = ("off", "lookup", "auto", "draft", "mtp")


def run(llm, ids: list[int], mode: str, tokens: int) -> dict:
    """One run's decode tok/s and figures."""
    h = llm.submit(ids, tokens, temperature=0, ignore_eos=True, speculative=mode)
    out = h.wait()
    st = h.stats
    by_pos = [k / r for k, r in zip(st.draft_kept, st.draft_reached)][:8]
    return {"tok_s": st.decode_tps, "tpf": st.tokens_per_forward, "drafted": st.drafted, "accepted": st.accepted,
            "by_pos": by_pos, "tokens": out}


def runs(llm, ids: list[int], modes, tokens: int, repeats: int) -> dict[str, dict]:
    """Per mode: the median decode tok/s of `repeats` runs, the modes alternated run by run (a drift of the
    machine's speed then touches each alike; a short run in RAM varies by up to +-30% here), and the last run's
    figures. Each measured run follows an unmeasured one of its own mode: the runner's timings (the plain step's,
    the decode threads' choice, the native runs' length) then are that mode's, not the previous mode's."""
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    last: dict[str, dict] = {}
    for _ in range(repeats):
        for mode in modes:
            run(llm, ids, mode, tokens)
            last[mode] = run(llm, ids, mode, tokens)
            speeds[mode].append(last[mode]["tok_s"])
    return {m: {**last[m], "tok_s": statistics.median(speeds[m])} for m in modes}


def table(title: str, llm, tokens: int, repeats: int, sources=SOURCES) -> None:
    print(f"\n## {title}  (load {os.getloadavg()[0]:.2f})")
    print("| prompt | source | tok/s | vs off | tokens/forward | accepted | by position (first 8) | same text |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for name, text in PROMPTS.items():
        ids = llm.tokenizer.encode(text)
        got = runs(llm, ids, sources, tokens, repeats)
        base = got["off"]
        for mode in sources:
            r = got[mode]
            pos = " ".join(f"{p:.2f}" for p in r["by_pos"]) or "-"
            acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
            print(f"| {name} | {mode} | {r['tok_s']:.0f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['tpf']:.2f} | "
                  f"{acc} | {pos} | {'yes' if r['tokens'] == base['tokens'] else 'NO'} |", flush=True)
    print(f"(load after: {os.getloadavg()[0]:.2f})")
    costs(llm)


def costs(llm) -> None:
    """What a forward costs by its rows (the verify steps' EWMA, engine/speculative.py StepCosts) next to a plain
    step of one sequence (a single step, or a native run's per step): the bound on what drafts can gain."""
    sp, runner = llm._runner.spec, llm._runner
    print("verify step by rows:", ", ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in sorted(sp.costs.s.items())),
          f"| plain step (1 seq): {runner._step_s.get(1, float('nan')) * 1e3:.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200, help="tokens a run, streamed and --synth")
    ap.add_argument("--tokens-ram", type=int, default=800,
                    help="tokens a run in RAM (~10k tok/s: long enough that a run is not decided by jitter)")
    ap.add_argument("--repeats", type=int, default=3, help="runs a source, streamed and --synth")
    ap.add_argument("--repeats-ram", type=int, default=9,
                    help="runs a source in RAM (~0.1 s each, bimodal here: ~100 or ~145 ms for the same 800 tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mem-budget", default="2M", help="the streamed setting's budget (the demo is 6.7 MiB)")
    ap.add_argument("--skip-streamed", action="store_true")
    ap.add_argument("--synth", type=Path, help="a random-init container: what auto decides there")
    a = ap.parse_args()
    draft, target = demo_model("int8", draft=True), demo_model("int8", mtp=True)
    with colibri.load(target, ctx_size=1024, threads=a.threads, draft_model=draft, mtp=True) as llm:
        table("demo int8, in RAM", llm, a.tokens_ram, a.repeats_ram)
    if not a.skip_streamed:
        with Container(target) as c, Container(draft) as d:  # (the target keeps --mem-budget for itself)
            budget = parse_size(a.mem_budget) + mtp_bytes(c) + model_sizes(d).total_bytes
        with colibri.load(target, ctx_size=1024, threads=a.threads, draft_model=draft, mtp=True,
                          mem_budget=budget) as llm:
            table(f"demo int8, --mem-budget {a.mem_budget} ({llm.plan.describe()})", llm, a.tokens, a.repeats)
    if a.synth:
        with colibri.load(a.synth, ctx_size=1024, threads=a.threads) as llm:
            ids = llm.tokenizer.encode(PROMPTS["edit"])[:40] * 3
            got = runs(llm, ids, ("off", "auto", "lookup"), a.tokens, a.repeats)
            off, auto, look = got["off"], got["auto"], got["lookup"]
            print(f"\n## {a.synth.name}: a prompt said 3 times  (load {os.getloadavg()[0]:.2f})")
            for name, r in (("off", off), ("auto", auto), ("lookup", look)):
                print(f"{name:7s} {r['tok_s']:.1f} tok/s, {r['tpf']:.2f} tokens/forward, drafts "
                      f"{r['accepted']}/{r['drafted']}, same text: {r['tokens'] == off['tokens']}")
            costs(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
