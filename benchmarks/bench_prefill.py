"""Prefill by prompt length: colibri's step plan (native 64-row steps for prompts of at most
`Scheduler.native_prompt` rows) against the GEMM plan (torch GEMM steps until 192 rows are left, the former one)
and llama.cpp's pp, same checkpoint, same run.

    .venv/bin/python benchmarks/bench_prefill.py [--shape 0.44b] [--schemes int8 int4]
        [--lengths 128 256 384 512 1024] [--after 0] [--rounds 3] [--threads 2] [--workdir /tmp/colibri-bench]

Same checkpoint and converters as bench_vs_llamacpp.py. colibri runs in one process per scheme
(prompt caching off: every prompt is computed), the two plans interleaved per length, --rounds
times; prefill tok/s = prompt tokens / time to the first token, median of the rounds. llama.cpp:
llama-bench -p LENGTH (its pp, --rounds repeats). Printed with the ratios and the load average.
--after C: each colibri prompt is C tokens its slot already holds (prompt caching on) and LENGTH
new ones, a chat turn deep in a conversation (llama-bench has no such test: its column is then pp
from an empty context, for scale).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llamacpp  # noqa: E402  (benchmarks/ is not a package)
from bench_vs_llamacpp import GGUF_TYPE, SHAPES, measured, prepare  # noqa: E402


def worker(a: argparse.Namespace) -> None:
    """In a fresh process: {length: {"native": tok/s, "gemm": tok/s}} as JSON on stdout."""
    import colibri

    llm = colibri.load(a.model, ctx_size=a.after + max(*a.lengths, 700) + 8, threads=a.threads,
                       cache_prompt=a.after > 0)
    rng = random.Random(0)
    native_prompt = llm._sched.native_prompt
    head = [1] + [rng.randrange(3, 384) for _ in range(a.after - 1)] if a.after else []  # ids the test tokenizer has
    if head:
        llm.submit(head, 1, ignore_eos=True).wait()

    def prefill(n: int, plan: int) -> float:
        llm._sched.native_prompt = plan
        prompt = head + [rng.randrange(3, 384) for _ in range(n)] if head else \
            [1] + [rng.randrange(3, 384) for _ in range(n - 1)]
        t0 = time.perf_counter()
        h = llm.submit(prompt, 1, ignore_eos=True)
        h.wait()
        t = time.perf_counter() - t0
        assert h.stats.cached_tokens >= len(head)  # (more when the new part starts as the last one did)
        return (len(prompt) - h.stats.cached_tokens) / t

    for n in (64, 300, 700):  # warm-up: both paths
        prefill(n, native_prompt)
        prefill(n, 0)
    out = {}
    for n in a.lengths:
        runs: dict[str, list[float]] = {"native": [], "gemm": []}
        for _ in range(a.rounds):
            runs["native"].append(prefill(n, native_prompt))
            runs["gemm"].append(prefill(n, 0))
        out[n] = {k: statistics.median(v) for k, v in runs.items()}
    llm.close()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.44b")
    ap.add_argument("--schemes", nargs="+", choices=sorted(GGUF_TYPE), default=["int8", "int4"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 384, 512, 1024])
    ap.add_argument("--after", type=int, default=0, help="tokens of each prompt already in the slot's cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/colibri-bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    cache = a.workdir / "llamacpp"
    bin_dir = llamacpp.build(cache)
    _, colis, ggufs = prepare(a.shape, a.workdir, a.schemes, cache)
    after = f", after {a.after} cached positions" if a.after else ""
    print(f"shape {a.shape}, {a.threads} threads{after}; prefill tok/s (prompt / time to first token, median of "
          f"{a.rounds}); colibri: native = the plan (64-row steps up to native_prompt rows), gemm = GEMM steps "
          "until 192 rows are left (native_prompt 0; the same plan at <= 192 and > native_prompt rows: those "
          "lengths show the noise); llama.cpp: llama-bench pp")
    print(f"{'scheme':<8}{'length':>7}{'native':>9}{'gemm':>9}{'llama':>9}{'native/gemm':>13}"
          f"{'native/llama':>14}{'load':>6}")
    for s in a.schemes:
        cmd = [sys.executable, __file__, "--worker", "--model", str(colis[s]), "--threads", str(a.threads),
               "--rounds", str(a.rounds), "--after", str(a.after), "--lengths", *map(str, a.lengths)]
        r = measured(cmd, env={"PYTHONPATH": str(ROOT)})
        if r["rc"] != 0:
            raise SystemExit(f"colibri worker failed:\n{r['stderr'][-2000:]}")
        c = json.loads(r["stdout"].strip().splitlines()[-1])
        for n in a.lengths:
            p = subprocess.run(llamacpp.bench_cmd(bin_dir, ggufs[s], a.threads, n, 0, a.rounds),
                               capture_output=True, text=True)
            ll = llamacpp.parse_bench(p.stdout).get("prefill_tok_s") if p.returncode == 0 else None
            nat, gem = c[str(n)]["native"], c[str(n)]["gemm"]
            print(f"{s:<8}{n:>7}{nat:>9.1f}{gem:>9.1f}{ll or float('nan'):>9.1f}{nat / gem:>12.2f}x"
                  f"{(nat / ll if ll else float('nan')):>13.2f}x{os.getloadavg()[0]:>6.1f}")


if __name__ == "__main__":
    main()
