"""RSS over a long generation: bf16 / int8 / int4, with and without --mem-budget (the demo model).

    .venv/bin/python benchmarks/bench_memory.py [--tokens 4000] [--schemes bf16,int8,int4]

    .venv/bin/python benchmarks/bench_memory.py --model M.coli --budget 100M   # any other model

Prints RSS (MiB) after 0 (model loaded), 100, 250, 1000, 2000, 4000 generated tokens, the growth from
token 100 to the end (target: < 32 MiB), and the peak RSS of the whole run (VmHWM, load included);
for budgeted runs also the resident weights and peak RSS - B, the runtime's fixed overhead (docs/TIERS.md,
"The runtime's fixed overhead", states its bound). The default budget is smaller than every demo variant,
so routed experts stream from disk (checksummed on each read). Each configuration runs in its own
process so that one does not inherit another's heap. tests/test_memory.py checks the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MARKS = (0, 100, 250, 1000, 2000, 4000)


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


def peak_mib() -> float:
    """This process's RSS high-water mark. VmHWM, not getrusage: ru_maxrss survives exec, so a child
    started by a big parent (pytest) would report the parent's peak."""
    return rss_mib("VmHWM")


def measure(path: str, tokens: int, mem_budget: int | None, threads: int) -> dict[str, float]:
    """RSS at each mark of one long greedy generation (run in this process), plus "peak" (MiB, the
    whole process's high-water mark), "resident" (MiB of weights the store holds) and "misses"."""
    import colibri

    llm = colibri.load(path, ctx_size=tokens + 16, threads=threads, mem_budget=mem_budget)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    out = {"0": rss_mib()}
    ids = llm.tokenizer.encode("Once upon a time")
    for n, _ in enumerate(llm.generate_ids(ids, tokens, temperature=0, ignore_eos=True), 1):
        if n in MARKS:
            out[str(n)] = rss_mib()
    s = llm.store_stats()
    out.update(peak=peak_mib(), resident=s["resident_bytes"] / 2**20,
               misses=s["misses"])
    llm.close()
    return out


def run_child(path: str, budget: int | None, tokens: int, threads: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--threads", str(threads), "--child", path,
           "-" if budget is None else str(budget), str(tokens)]
    return json.loads(subprocess.check_output(cmd, text=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--schemes", default="bf16,int8,int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", default="3M", help="the --mem-budget of the budgeted runs")
    ap.add_argument("--model", help="measure this .coli (one row pair) instead of the demo variants")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "BUDGET", "TOKENS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        path, budget, tokens = a.child
        print(json.dumps(measure(path, int(tokens), None if budget == "-" else int(budget), a.threads)))
        return
    from colibri.demo import demo_model
    from colibri.store.placement import parse_size

    print(f"load average {os.getloadavg()[0]:.2f} (shared machine); RSS in MiB after N generated tokens "
          f"({a.model or 'demo model'}, {a.threads} thread(s))")
    marks = [m for m in MARKS if m <= a.tokens]
    print(f"{'scheme':6} {'budget':>7} | " + " | ".join(f"{m:>6}" for m in marks)
          + " | growth 100->end | peak RSS | weights | peak - B | misses")
    models = [("file", a.model)] if a.model else [(s, None) for s in a.schemes.split(",")]
    for scheme, model in models:
        path = model or str(demo_model(scheme))
        for budget in (None, parse_size(a.budget)):
            res = run_child(path, budget, a.tokens, a.threads)
            rss = {int(k): v for k, v in res.items() if k.isdigit()}
            growth = rss[max(rss)] - rss.get(100, rss[0])
            over = f"{res['peak'] - budget / 2**20:8.0f}" if budget else f"{'-':>8}"
            print(f"{scheme:6} {a.budget if budget else '-':>7} | " + " | ".join(f"{rss.get(m, 0):6.0f}" for m in marks)
                  + f" | {growth:+15.1f} | {res['peak']:8.0f} | {res['resident']:7.1f} | {over} | {res['misses']:.0f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
