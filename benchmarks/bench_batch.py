"""Concurrent requests through one Engine: 1, 2, 4, 8 prompts at once (generate_batch).

    .venv/bin/python benchmarks/bench_batch.py [--tokens 64] [--workdir /tmp/colibri-bench]

Two settings on an OLMoE-shaped random model (hidden 1024, 8 layers, 32 experts top-4, expert
width 512, 16 heads, vocab 32000; 0.44B parameters, int8):
- ram: everything resident;
- streamed: `--mem-budget` about 1/1.5 of the file, experts read from disk into the expert cache,
  run under `../shared/tools/memcap` (found relative to this checkout) from a cold page cache.
Every N runs `--rounds` times, interleaved (1, 2, 4, 8, 1, 2, ...); per N the run with the median
aggregate tok/s is printed, with every round's figure. Columns: aggregate tok/s (N x tokens / wall
time of the batch), mean per-request decode tok/s, unique vs summed experts per MoE layer and step
(what the batch fetched vs what its sequences would have fetched alone), expert bytes read per
generated token and the read rate they make (GB/s), hit rate, and each N against N=1, with the load average.
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

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT.parent / "shared" / "tools"
SHAPE = dict(num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, hidden_size=1024,
             intermediate_size=512, vocab_size=32000)
PROMPTS = ["The history of the city begins", "In a small village by the sea", "The theory of relativity says",
           "Once upon a time there was", "The best way to cook rice is", "Machine learning models can",
           "The river flows through the valley", "A good night's sleep helps"]


def prepare(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synth_ckpt import write_olmoe

    from colibri.convert.converter import convert

    # (its own names: bench_vs_llamacpp.py's 0.44b files in the same workdir have the test vocabulary)
    hf, coli = work / "olmoe-0.44b-v32k-hf", work / "olmoe-0.44b-v32k.int8.coli"
    if not (hf / "config.json").exists():
        write_olmoe(hf, num_key_value_heads=16, num_attention_heads=16, **SHAPE)
    if not coli.exists():
        convert(hf, coli, "int8", 64, progress=False)
    return coli


def child(path: str, budget: str | None, tokens: int, threads: int, counts: list[int], prefetch: bool,
          policy: str, rounds: int) -> list[dict]:
    import colibri
    from colibri.store.placement import parse_size

    # No prompt caching: every round sends the same prompts, and each should cost what the first did.
    llm = colibri.load(path, ctx_size=256, threads=threads, slots=max(counts), cache_prompt=False,
                       mem_budget=parse_size(budget) if budget else None, prefetch=prefetch, cache_policy=policy)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    # Warm-up: every count's path, with enough tokens to touch (nearly) every expert: the first touch of a
    # mapped page faults, and a warm-up of a few tokens left that to the first measured run (N=1 then
    # ran at ~0.75 of its steady speed, flattering every ratio to it).
    llm.generate_batch(PROMPTS[:max(counts)], max_tokens=tokens, ignore_eos=True)
    llm.generate_batch(PROMPTS[:1], max_tokens=tokens, ignore_eos=True)
    rows = []
    # Rounds of 1, 2, 4, 8 in turn: this VM's memory bandwidth and clock move between modes within
    # seconds (one run's N=1 ranged 253-356 tok/s), so every N gets a run in each stretch.
    for n in [n for _ in range(rounds) for n in counts]:
        m0 = llm.metrics()
        t0 = time.perf_counter()
        handles = [llm.submit(llm.tokenizer.encode(p), tokens, ignore_eos=True) for p in PROMPTS[:n]]
        for h in handles:
            h.wait()
        wall = time.perf_counter() - t0
        m1 = llm.metrics()
        gen = sum(h.stats.generated for h in handles)
        uniq = m1["experts_unique"] - m0["experts_unique"]
        summed = m1["experts_summed"] - m0["experts_summed"]
        steps = m1["steps"] - m0["steps"]
        read = m1["store"]["bytes_read"] - m0["store"]["bytes_read"]
        hits = m1["store"]["hits"] - m0["store"]["hits"]
        looks = hits + m1["store"]["misses"] - m0["store"]["misses"]
        rows.append(dict(n=n, agg=gen / wall, per_req=sum(h.stats.decode_tps for h in handles) / n,
                         unique_per_step=uniq / steps / 8, summed_per_step=summed / steps / 8,
                         bytes_per_token=read / gen, hit_rate=hits / looks if looks else 0.0))
    llm.close()
    return rows


def run_mode(path: Path, a: argparse.Namespace, capped: bool) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", str(path), "--tokens", str(a.tokens), "--threads", str(a.threads),
           "--counts", a.counts, "--prefetch", a.prefetch, "--cache-policy", a.cache_policy,
           "--rounds", str(a.rounds)]
    if capped:
        cmd += ["--mem-budget", a.mem_budget]
        subprocess.run([str(TOOLS / "evict"), str(path)], check=True)
        cmd = [str(TOOLS / "memcap"), a.cap, *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"run failed ({p.returncode}): {p.stderr[-2000:]}")
    peak = re.search(r"memcap: limit \S+, peak (\d+) MiB", p.stderr)
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    for r in rows:
        r["cgroup_peak_mib"] = int(peak[1]) if peak else None
    return rows


def median_run(runs: list[dict]) -> dict:
    """The run with the median aggregate tok/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["agg"])[(len(runs) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/colibri-bench")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--mem-budget", default="300M", help="weights budget of the streamed run (file ~450 MB)")
    ap.add_argument("--cap", default="900M", help="memcap limit of the streamed run (RSS + page cache)")
    ap.add_argument("--modes", default="ram,streamed")
    ap.add_argument("--prefetch", choices=("on", "off"), default="on",
                    help="the streamed run's look-ahead prefetch (colibri.load's prefetch)")
    ap.add_argument("--cache-policy", default="reuse", help="the streamed run's expert cache policy")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of every N, interleaved (1,2,4,8,1,2,...); each N's median run is printed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    counts = [int(c) for c in a.counts.split(",")]
    if a.child:
        print(json.dumps(child(a.child, getattr(a, "mem_budget", None) if "--mem-budget" in sys.argv else None,
                               a.tokens, a.threads, counts, a.prefetch == "on",
                               a.cache_policy, a.rounds)))
        return
    path = prepare(Path(a.workdir))
    print(f"model {path} ({path.stat().st_size / 2**20:.0f} MiB), {a.tokens} new tokens per request, "
          f"{a.threads} threads")
    for mode in a.modes.split(","):
        la = os.getloadavg()[0]
        runs = run_mode(path, a, mode == "streamed")
        rows = [median_run([r for r in runs if r["n"] == n]) for n in counts]
        base = rows[0]["agg"]
        extra = f", --mem-budget {a.mem_budget} under memcap {a.cap}" if mode == "streamed" else ""
        print(f"\n[{mode}{extra}] load average before {la:.2f}, after {os.getloadavg()[0]:.2f}")
        print(f"{'N':>3} {'agg tok/s':>10} {'per-req tok/s':>14} {'unique/step':>12} {'summed/step':>12} "
              f"{'MiB read/tok':>13} {'read GB/s':>10} {'hit rate':>9} {'vs N=1':>7}  agg tok/s of each round")
        for r in rows:  # (read GB/s: the disk's pace while the batch ran)
            print(f"{r['n']:>3} {r['agg']:>10.1f} {r['per_req']:>14.1f} {r['unique_per_step']:>12.1f} "
                  f"{r['summed_per_step']:>12.1f} {r['bytes_per_token'] / 2**20:>13.2f} "
                  f"{r['bytes_per_token'] * r['agg'] / 1e9:>10.2f} {r['hit_rate']:>9.1%} {r['agg'] / base:>6.2f}x  "
                  + " ".join(f"{x['agg']:.1f}" for x in runs if x["n"] == r["n"]))
        if rows[0].get("cgroup_peak_mib"):
            print(f"cgroup peak {rows[0]['cgroup_peak_mib']} MiB")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
