"""Tiers under a memory cap: an OLMoE-1B-7B-shaped model (~7 GB at int8) in 3.5 GB.

    .venv/bin/python benchmarks/bench_capped.py [--workdir /tmp/colibri-bench] [--schemes int8 int4]
        [--cap 3500M] [--mem-budget 2400M] [--tokens 32] [--threads 2] [--hot-set]

1. Writes a random OLMoE-1B-7B-shaped checkpoint (16 layers, 64 experts top-8, hidden 2048,
   expert width 1024, 16 heads, vocab 50304) tensor by tensor (benchmarks/synth_ckpt.py: no
   transformers instantiation), and converts it to int8 and int4. Everything is cached in
   --workdir and skipped when present (here, on a shared 2-core box: generation 7 min, int8
   conversion 10 min, int4 conversion 44 min).
2. Per scheme: `colibri bench` uncapped (page cache warmed first: the steady state of a model
   that fits in RAM), then under `memcap CAP` with the container evicted from the page cache
   and `--mem-budget` for the weights, and checks that both runs produced the same tokens.
3. Prints tok/s, cache hit rate, GB read per token, peak RSS (process) and the cgroup's peak
   (RSS + page cache). colibri only: for llama.cpp on the same checkpoint, in the same run,
   use `benchmarks/bench_vs_llamacpp.py --shape 7b` (it builds llama.cpp and runs both capped).
4. --hot-set: the uncapped run records routing counts (--usage-file), and a third run, capped
   again, pins the experts hot in it (learned on the same prompts: the repeat-workload case).

The budget is for weights only (dense + expert cache): the process adds runtime, KV cache and
activations, and the cgroup also counts page cache, so --mem-budget must stay well under --cap
(see BUDGET). memcap and evict are ../shared/tools next to the checkout; without them the
capped runs are skipped. Other work on the machine swings every figure (OpenMP threads spin-wait when a
core is taken): compare runs made back to back, and note the load average printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Weights budget under the 3.5 GB cap, per scheme (shared with bench_vs_llamacpp.py, which explains it);
# memcap/evict live in ../shared/tools next to the checkout (TOOLS, shared_tools()).
from bench_vs_llamacpp import BUDGET, TOOLS, shared_tools  # noqa: E402


def prepare(workdir: Path, schemes: list[str]) -> dict[str, Path]:
    from synth_ckpt import write_olmoe

    from colibri.convert.converter import convert

    hf = workdir / "olmoe-7b-hf"
    if not (hf / "config.json").exists():
        t0 = time.perf_counter()
        write_olmoe(hf)
        print(f"generated {hf} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    out = {}
    for s in schemes:
        out[s] = workdir / f"olmoe-7b.{s}.coli"
        if not out[s].exists():
            t0 = time.perf_counter()
            convert(hf, out[s], s, 64, progress=False)
            print(f"converted {out[s]} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return out


def bench(model: Path, a: argparse.Namespace, cap: str | None, mem_budget: str | None,
          usage: Path | None = None) -> dict:
    """One `colibri bench --json` run in a fresh process (under memcap when `cap`)."""
    cmd = [sys.executable, "-m", "colibri", "bench", "--model", str(model), "-n", str(a.tokens),
           "--prompts", str(a.prompts), "--ctx-size", str(a.ctx_size), "--threads", str(a.threads), "--json",
           "--spec", "off"]  # (plain decoding, as llama.cpp's)
    if mem_budget:
        cmd += ["--mem-budget", mem_budget]
    if usage is not None:
        cmd += ["--usage-file", str(usage)]
    if cap:
        cmd = [str(TOOLS / "memcap"), cap, *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    m = re.search(r"memcap: limit \S+, peak (\d+) MiB, exit (\d+)", p.stderr)
    if p.returncode != 0:
        why = "OOM-killed by the cap" if p.returncode == 137 else f"exit {p.returncode}"
        return {"error": f"{why}: {p.stderr.strip()[-800:]}", "cgroup_peak_mib": int(m[1]) if m else None}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["cgroup_peak_mib"] = int(m[1]) if m else None
    r["wall_s"] = wall
    return r


def evict(path: Path) -> None:
    subprocess.run([str(TOOLS / "evict"), str(path)], check=True)  # only called when shared_tools()


def warm(path: Path) -> None:
    """Read the file once so the uncapped run starts from a warm page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def row(scheme: str, mode: str, r: dict) -> str:
    if "error" in r:
        return f"{scheme:<6}{mode:<11} failed: {r['error']}"
    hr, bpt = r.get("cache_hit_rate"), r.get("decode_bytes_read_per_token")
    cg = r.get("cgroup_peak_mib")
    return (f"{scheme:<6}{mode:<11}{r['decode_tok_s']:>9.2f}{r['prefill_tok_s']:>10.1f}"
            f"{'-' if hr is None else f'{hr:.1%}':>9}{'-' if bpt is None else f'{bpt / 1e9:.3f}':>10}"
            f"{r['peak_rss_mib']:>10.0f}{'-' if cg is None else cg:>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/colibri-bench")
    ap.add_argument("--schemes", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    ap.add_argument("--cap", default="3500M", help="memcap limit (RSS + page cache of the run)")
    ap.add_argument("--mem-budget", help="colibri --mem-budget (weights) under the cap; default per scheme: "
                    + ", ".join(f"{k} {v}" for k, v in BUDGET.items()))
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=1, help="how many of colibri bench's prompts")
    ap.add_argument("--ctx-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-uncapped", action="store_true")
    ap.add_argument("--hot-set", action="store_true", help="also run capped with the hot set (--usage-file) "
                    "the uncapped run recorded on the same prompts")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    models = prepare(work, a.schemes)
    budgets = a.mem_budget or ", ".join(f"{k} {BUDGET[k]}" for k in a.schemes)
    print(f"OLMoE-1B-7B-shaped random model; {a.prompts} prompt(s) x {a.tokens} greedy tokens, {a.threads} "
          f"threads; capped = memcap {a.cap}, cold page cache, --mem-budget {budgets}", flush=True)
    print(f"{'quant':<6}{'run':<11}{'tok/s':>9}{'prefill':>10}{'hit':>9}{'GB/tok':>10}{'RSS MiB':>10}"
          f"{'cg MiB':>10}")
    results = {}
    for s, path in models.items():
        size = path.stat().st_size / 2**30
        usage = work / f"usage-{s}.json" if a.hot_set else None
        if usage is not None:
            usage.unlink(missing_ok=True)
        if not a.skip_uncapped:
            warm(path)
            results[s, "uncapped"] = r = bench(path, a, None, None, usage)
            print(row(s, "uncapped", r), flush=True)
        if shared_tools() is None:
            print(f"      {s}: capped runs skipped: no memcap/evict in {TOOLS}", flush=True)
            continue
        evict(path)
        budget = a.mem_budget or BUDGET[s]
        results[s, "capped"] = r = bench(path, a, a.cap, budget)
        print(row(s, "capped", r), flush=True)
        if usage is not None and usage.exists():
            evict(path)
            results[s, "capped+hot"] = hot = bench(path, a, a.cap, budget, usage)
            print(row(s, "capped+hot", hot), flush=True)
            if "error" not in hot and "error" not in r and hot["outputs"] != r["outputs"]:
                print(f"      {s}: capped+hot output != capped output", flush=True)
        un = results.get((s, "uncapped"))
        if un and "error" not in un and "error" not in r:
            same = un["outputs"] == r["outputs"]
            verdict = "==" if same else "!="
            print(f"      {s} ({size:.2f} GiB): capped output {verdict} uncapped output", flush=True)
    print(f"load average now {os.getloadavg()[0]:.1f}; llama.cpp on the same checkpoint, same run: "
          "benchmarks/bench_vs_llamacpp.py --shape 7b")
    (work / "bench_capped.json").write_text(json.dumps({f"{k[0]}/{k[1]}": v for k, v in results.items()},
                                                       default=str))


if __name__ == "__main__":
    main()
