"""How far a better look-ahead could take streamed decode: the store's look-ahead against none and against an
oracle that knows the routes, in the same run.

    .venv/bin/python benchmarks/bench_lookahead.py --model M.coli --mem-budget 800M [--tokens 64] [--rounds 3]
        [--depths 1,2]

Each mode loads the model afresh under `--mem-budget` (the expert cache starts empty), decodes `colibri bench`'s
prompts greedily once to warm the cache (and, for the oracle, to record every routed layer's experts in the
order the store fetches them), then decodes them again, timed. Modes:

- `store`: the look-ahead as shipped (the next routed layer's router on the residual, per-rank precision gate);
- `none`: no look-ahead (`prefetch=False`): every miss read when its layer asks;
- `oracle-D`: at each routed layer, the true experts of the next D routed layers (recorded in the warm-up pass;
  greedy tokens, hence routes, are the same in both) are read ahead through the same `prefetch` as the store's
  (the same slots and shares; a read ahead only takes the reader's idle places): what a perfect predictor gives;
- `oracle-Dq`: the same, its reads queued behind those in flight (no wrong read to delay a demand read).

A step's first routed layer has nothing before it to read ahead from (its routes follow the token just
sampled), so its misses are read while the step waits, in every mode.

Prints per mode and round: decode tok/s (tokens after each prompt's first, over the time since its first),
MB read a token, the step's waits on reads, the reader's busy time and bandwidth, and the share of the limit
1 / max(disk time, in-RAM step) with the in-RAM step taken from an all-in-RAM load of the same file in the same
run; then the medians and the ratios to `store`, with the load average. Modes alternate within each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import colibri  # noqa: E402
from colibri.analysis.bench import PROMPTS  # noqa: E402


class Oracle:
    """Stands in for the store's LookAhead (`source.ahead`): reads ahead the routes recorded for the next
    `depth` fetches instead of predicting them. `record` fills the routes; `play` replays them."""

    def __init__(self, source, ahead, depth: int, queue: bool):
        self.source, self.next, self.depth = source, ahead.next, depth
        if queue:
            for cache in source.cached.values():
                cache.io_depth = 0  # (unbounded: prefetch then queues behind the reads in flight)
        self.routes: list[tuple[int, list[int]]] = []
        self.pos = -1  # index of the fetch being served, in `routes`
        self.mismatches = 0
        self.playing = False
        fetch = source.fetch

        def traced(layer: int, ids: list[int], **kw):
            if self.playing:
                self.pos += 1
                got = self.routes[self.pos] if self.pos < len(self.routes) else (-1, [])
                # (a prompt's rows may differ between the passes, the prefix cache holding some: only the
                # order of the layers and each decode step's experts must match)
                if got[0] != layer or (len(got[1]) == len(ids) and got[1] != list(ids)):
                    self.mismatches += 1
            else:
                self.routes.append((layer, list(ids)))
            return fetch(layer, ids, **kw)

        source.fetch = traced  # (an instance attribute: the layer hook calls source.fetch)

    def __call__(self, layer: int, h) -> None:  # (the torch look-ahead's entry: same as the kernel's)
        self.read(layer, None)

    def read_row(self, layer: int, ids) -> None:
        self.read(layer, None)

    def read(self, layer: int, idx) -> None:
        if not self.playing:
            return
        for j in range(self.pos + 1, min(self.pos + 1 + self.depth, len(self.routes))):
            target, ids = self.routes[j]
            if len(ids) <= len(self.routes[self.pos][1]):  # (the same step: a prompt chunk's union is wider)
                self.source.prefetch(target, ids, False)


def decode(llm, prompts: tuple[str, ...], tokens: int) -> tuple[float, int]:
    """Seconds spent decoding (after each prompt's first token) and tokens decoded, greedy."""
    spent, n = 0.0, 0
    for p in prompts:
        h = llm.submit(llm.tokenizer.encode(p), tokens, speculative="off")
        t0 = None
        for _ in h:
            if t0 is None:
                t0 = time.perf_counter()
            else:
                n += 1
        spent += time.perf_counter() - t0
    return spent, n


def run_mode(model: str, budget: str, mode: str, tokens: int, threads: int) -> dict:
    llm = colibri.load(model, mem_budget=budget, threads=threads, prefetch=mode != "none")
    try:
        oracle = None
        if mode.startswith("oracle-"):
            src = llm.store.source
            oracle = Oracle(src, src.ahead, int(mode.split("-")[1].rstrip("q")), mode.endswith("q"))
            src.ahead = oracle
        decode(llm, PROMPTS, tokens)  # warm-up (and the oracle's record)
        if oracle is not None:
            oracle.playing = True
        s0 = llm.store_stats()
        spent, n = decode(llm, PROMPTS, tokens)
        s1 = llm.store_stats()
    finally:
        llm.close()
    d = {k: s1[k] - s0[k] for k in ("decode_bytes_read", "decode_io_wait_s", "decode_reader_busy_s",
                                    "decode_reader_bytes", "prefetch_issued", "prefetch_wasted")}
    busy = d["decode_reader_busy_s"]
    return {"tok_s": n / spent, "mb": d["decode_bytes_read"] / n / 1e6, "wait_ms": d["decode_io_wait_s"] / n * 1e3,
            "busy_ms": busy / n * 1e3, "gbps": d["decode_reader_bytes"] / busy / 1e9 if busy else 0.0,
            "ahead": d["prefetch_issued"] / n, "wasted": d["prefetch_wasted"] / n,
            "mismatch": oracle.mismatches if oracle else 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .coli container larger than --mem-budget")
    ap.add_argument("--mem-budget", default="800M")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (4 prompts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", default="1,2", help="oracle depths, in routed layers ahead")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    modes = ["store", "none"] + [f"oracle-{d}{q}" for d in a.depths.split(",") if d for q in ("", "q")]
    ram = colibri.load(a.model, threads=a.threads)
    try:
        decode(ram, PROMPTS, a.tokens)
        spent, n = decode(ram, PROMPTS, a.tokens)
    finally:
        ram.close()
    step = spent / n
    print(f"in RAM: {n / spent:.2f} tok/s ({step * 1e3:.2f} ms a step); load {os.getloadavg()[0]:.2f}")
    print("| round | mode | tok/s | MB/token | wait ms | reader busy ms | GB/s | reads ahead | wasted | share |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    res: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            x = run_mode(a.model, a.mem_budget, m, a.tokens, a.threads)
            if x["mismatch"]:
                print(f"warning: {x['mismatch']} fetches differed from the recorded ones (oracle off the routes)")
            disk = x["mb"] * 1e6 / (x["gbps"] * 1e9) if x["gbps"] else 0.0
            x["share"] = x["tok_s"] / (1 / max(disk, step))
            res[m].append(x)
            print(f"| {r + 1} | {m} | {x['tok_s']:.2f} | {x['mb']:.1f} | {x['wait_ms']:.2f} | {x['busy_ms']:.2f} | "
                  f"{x['gbps']:.2f} | {x['ahead']:.1f} | {x['wasted']:.2f} | {x['share']:.2f} |", flush=True)
    base = statistics.median(x["tok_s"] for x in res["store"])
    print(f"\nmedians (load {os.getloadavg()[0]:.2f}):")
    for m in modes:
        t, share, mb = (statistics.median(x[k] for x in res[m]) for k in ("tok_s", "share", "mb"))
        print(f"  {m:9s} {t:7.2f} tok/s  {t / base:.2f}x store  share {share:.2f}  MB/token {mb:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
