"""`colibri bench`: fixed prompts, greedy, a fixed number of tokens; speed, cache and memory figures.

    colibri bench --model M.coli [--mem-budget 3G] [-n 64] [--json]

Every run decodes the same embedded prompts greedily with EOS ignored, so two runs (two
machines, two builds, two budgets) differ only in what is being measured. A short warm-up
generation first pays one-off costs (oneDNN primitive creation, first page faults) unless
--no-warmup; the expert cache is *not* reset after it, which is what a served model sees.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .. import arena
from ..errors import ColibriError

# Different lengths and registers: a chat question, prose, code, a list. Fixed forever: changing
# them changes every benchmark figure.
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him. On the night of the storm the light failed, and the ships in the bay "
    "were left to find their own way through the rocks. He remembered what his father had said:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Here is a list of ten useful habits for learning a new language:\n1.",
)


def run_bench(llm, n_tokens: int, prompts: tuple[str, ...] = PROMPTS, warmup: bool = True) -> dict:
    """Run the prompts on a loaded Engine; returns the figures (see `colibri bench --help`)."""
    from ..api import peak_rss_mib
    from ..store.limit import decode_limit

    if warmup:  # (16 tokens: the engine times 1 and all decode threads over its first ~10 steps)
        for _ in llm.generate_ids(llm.tokenizer.encode("Hello"), 16, temperature=0.0, ignore_eos=True):
            pass
    runs = []
    before = llm.store_stats()
    t_all = time.perf_counter()
    for text in prompts:
        ids = llm.tokenizer.encode(text)
        toks = list(llm.generate_ids(ids, n_tokens, temperature=0.0, ignore_eos=True))
        st = llm.last_stats
        runs.append({"prompt_tokens": st.prompt_tokens, "cached": st.cached_tokens, "generated": st.generated,
                     "prefill_s": st.prefill_s,
                     "decode_s": st.decode_s, "ttft_s": st.ttft_s, "tokens": toks,
                     "spec": (st.drafted, st.accepted, st.forwards)})
    wall = time.perf_counter() - t_all
    prompt_toks = sum(r["prompt_tokens"] for r in runs)
    decoded = sum(max(r["generated"] - 1, 0) for r in runs)  # the first token comes from prefill
    prefill_s = sum(r["prefill_s"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    out = {
        "model": llm.container.path, "scheme": llm.scheme, "threads": llm.threads, "kv_cache": str(llm.kv_types),
        "kv_bytes": llm.kv_bytes(),
        "prompts": len(runs), "n_tokens": n_tokens, "prompt_tokens": prompt_toks,
        "generated": decoded + len(runs),
        # Prompt tokens computed (a slot's cache may hold the start of a prompt: engine/kv.py).
        "prefill_tok_s": sum(r["prompt_tokens"] - r["cached"] for r in runs) / prefill_s if prefill_s else 0.0,
        "decode_tok_s": decoded / decode_s if decode_s else 0.0,
        "ttft_ms": 1e3 * sum(r["ttft_s"] for r in runs) / len(runs),
        "wall_s": wall,
        "peak_rss_mib": peak_rss_mib(),
        "huge_pages_mib": arena.huge_pages_mib(),
        "outputs": [r["tokens"] for r in runs],
    }
    drafted, accepted, forwards = (sum(r["spec"][i] for r in runs) for i in range(3))
    out.update(speculative=llm.speculative, spec_drafted=drafted, spec_accepted=accepted,
               tokens_per_forward=(forwards + accepted) / forwards if forwards else 1.0)
    out.update(_store_figures(before, llm.store_stats()))
    # (the store's delta, decode_s and decoded cover the same runs: the measured ones, warm-up excluded)
    out.update(decode_limit(out["store_stats"], decode_s, decoded))
    out["loadavg"] = os.getloadavg()[0]  # other load on the box skews every figure: keep it on record
    return out


def plan_estimate(llm, budget: dict) -> tuple[float, float, str]:
    """The decode speed `colibri plan` expects for this model and these budgets on this machine, and
    its disk probe's bytes/s and note (the probes take about a second; run with the engine's threads,
    before the measured runs)."""
    from ..plan import PlanSizes, plan
    from .probe import probe_machine

    sizes = PlanSizes.from_container(llm.container)
    m = probe_machine(llm.container.path, 0.3, max(max(sizes.record_bytes, default=0), 4096), sizes.scheme)
    return plan(sizes, m, budget["mem_budget"], budget["gpu_budget"], llm.ctx_size).tok_s, m.disk_bps, m.disk_note


def _store_figures(before: dict, after: dict) -> dict:
    """Cache figures of the measured runs only (the warm-up and the load excluded)."""
    from ..store.tiered import stats_delta

    s = stats_delta(before, after)
    cached = s.get("lookups", 0) > 0  # no disk tier: hit rate and prefetch do not apply
    return {"cache_hit_rate": s["hit_rate"] if cached else None,
            "bytes_read_per_token": s["bytes_per_token"],
            "decode_bytes_read_per_token": s["decode_bytes_per_token"],
            "prefetch_precision": s["prefetch_precision"] if s.get("pred_total") else None,
            "prefetch_recall": s["prefetch_recall"] if s.get("actual_total") else None,
            # look-ahead reads evicted before any step asked for them, per token
            "prefetch_wasted_bytes_per_token": s["prefetch_wasted_bytes"] / s["tokens"] if cached and s["tokens"]
            else None,
            "store_stats": s}


def format_text(r: dict) -> str:
    from ..store.limit import limit_text

    def opt(v, fmt: str) -> str:
        return "n/a" if v is None else fmt.format(v)

    bpt, waste = r["decode_bytes_read_per_token"], r["prefetch_wasted_bytes_per_token"]

    return "\n".join([
        f"model        {r['model']} ({r['scheme']}), {r['threads']} threads, KV cache {r['kv_cache']} "
        f"({r['kv_bytes'] / 2**20:.1f} MiB)",
        f"workload     {r['prompts']} prompts, {r['prompt_tokens']} prompt tokens, "
        f"{r['n_tokens']} greedy tokens each (EOS ignored)",
        f"prefill      {r['prefill_tok_s']:.1f} tok/s",
        f"decode       {r['decode_tok_s']:.2f} tok/s",
        f"TTFT         {r['ttft_ms']:.0f} ms (mean)",
        f"cache        hit rate {opt(r['cache_hit_rate'], '{:.1%}')}, "
        f"read {opt(None if bpt is None else bpt / 1e6, '{:.2f}')} "
        f"MB/decode token, prefetch precision {opt(r['prefetch_precision'], '{:.1%}')}, "
        f"recall {opt(r['prefetch_recall'], '{:.1%}')}, wasted "
        f"{opt(None if waste is None else waste / 1e6, '{:.2f}')} MB/token",
        f"limit        {limit_text(r)}",
        *([f"speculative  {r['speculative']}: {r['spec_accepted']}/{r['spec_drafted']} drafts accepted, "
           f"{r['tokens_per_forward']:.2f} tokens a forward"] if r.get("spec_drafted") else []),
        f"peak RSS     {r['peak_rss_mib']:.0f} MiB"
        + ("" if r.get("huge_pages_mib") is None else f", {r['huge_pages_mib']:.0f} MiB in huge pages"),
        f"load avg     {r['loadavg']:.1f} (other work on this machine while measuring)",
    ])


def main(argv: list[str] | None = None) -> int:
    from ..cli.common import add_engine_args, engine_from_args, setup_logging
    from ..cli.specflags import add_spec_args, apply_spec_args

    p = argparse.ArgumentParser(prog="colibri bench", description="Benchmark a model on fixed prompts "
                                "(greedy, EOS ignored): decode/prefill tok/s, TTFT, cache figures, peak RSS.")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help=f"use the first N of the {len(PROMPTS)} prompts")
    p.add_argument("--no-warmup", action="store_true", help="measure from a cold start")
    p.add_argument("--json", action="store_true", help="print one JSON object (machines) instead of text")
    add_engine_args(p, model_required=True, ctx_size=1024)
    add_spec_args(p)
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    if a.n_predict < 2 or not 1 <= a.prompts <= len(PROMPTS):
        raise ColibriError(f"need -n >= 2 and 1 <= --prompts <= {len(PROMPTS)}")
    from ..store.placement import parse_size

    budget = {"mem_budget": parse_size(a.mem_budget) if a.mem_budget else None,
              "gpu_budget": parse_size(a.gpu_budget) if a.gpu_budget else None}
    t0 = time.perf_counter()
    llm = engine_from_args(a)
    apply_spec_args(llm, a)
    load_s = time.perf_counter() - t0
    try:
        plan_tok_s, disk_bps, disk_note = plan_estimate(llm, budget)
    except BaseException:
        llm.close()
        raise
    recorder = None
    if a.usage_file:
        from .usage import Recorder

        recorder = Recorder(llm)
    try:
        r = run_bench(llm, a.n_predict, PROMPTS[: a.prompts], warmup=not a.no_warmup)
    finally:
        llm.close()
    if recorder is not None:
        recorder.usage().save(a.usage_file)
    r["load_s"] = load_s
    r["budget"] = budget
    r["plan_tok_s"] = plan_tok_s
    r["disk_probe_bps"], r["disk_probe_note"] = disk_bps, disk_note
    if a.json:
        print(json.dumps(r, default=str))
    else:
        ratio = r["decode_tok_s"] / plan_tok_s if plan_tok_s else 0.0
        print(format_text(r) + f"\nplan         {plan_tok_s:.2f} tok/s expected by colibri plan (measured / "
              f"expected = {ratio:.2f})\ndisk probe   {disk_bps / 1e9:.2f} GB/s ({disk_note})"
              f"\nload         {load_s:.2f} s")
    sys.stdout.flush()
    return 0
