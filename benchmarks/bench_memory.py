"""RSS over a long generation: bf16 / int8 / int4, with and without --mem-budget (the demo model).

    .venv/bin/python benchmarks/bench_memory.py [--tokens 4000] [--schemes bf16,int8,int4]

Prints RSS (MiB) after 0 (model loaded), 250, 1000, 2000, 4000 generated tokens and the growth from
token 100 to the end. Each configuration runs in its own process so that one does not inherit another's
heap. The test suite checks the same thing with a generous bound (tests/test_memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MARKS = (0, 100, 250, 1000, 2000, 4000)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def measure(path: str, tokens: int, mem_budget: int | None, threads: int) -> dict[int, float]:
    """RSS at each mark of one long greedy generation (run in this process)."""
    import colibri

    llm = colibri.load(path, ctx_size=tokens + 16, threads=threads, mem_budget=mem_budget)
    out = {0: rss_mib()}
    ids = llm.tokenizer.encode("Once upon a time")
    for n, _ in enumerate(llm.generate_ids(ids, tokens, temperature=0, ignore_eos=True), 1):
        if n in MARKS:
            out[n] = rss_mib()
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--schemes", default="bf16,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", default="24M", help="the --mem-budget of the budgeted runs")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "BUDGET", "TOKENS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        path, budget, tokens = a.child
        print(json.dumps(measure(path, int(tokens), None if budget == "-" else int(budget), a.threads)))
        return
    from colibri.demo import demo_model
    from colibri.store.placement import parse_size

    print(f"load average {os.getloadavg()[0]:.2f}; RSS in MiB after N generated tokens (demo model)")
    marks = [m for m in MARKS if m <= a.tokens]
    print(f"{'scheme':6} {'budget':>7} | " + " | ".join(f"{m:>6}" for m in marks) + " | growth 100->end")
    for scheme in a.schemes.split(","):
        path = str(demo_model(scheme))
        for budget in (None, parse_size(a.budget)):
            cmd = [sys.executable, __file__, "--threads", str(a.threads), "--child", path,
                   "-" if budget is None else str(budget), str(a.tokens)]
            res = {int(k): v for k, v in json.loads(subprocess.check_output(cmd, text=True)).items()}
            growth = res[max(res)] - res.get(100, res[0])
            print(f"{scheme:6} {a.budget if budget else '-':>7} | " + " | ".join(f"{res.get(m, 0):6.0f}" for m in marks)
                  + f" | {growth:+.1f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
