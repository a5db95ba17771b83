"""Multi-row attention, the rows of a prompt chunk ATTN_RB at a time per head (kernels/attn.c) vs one at a
time (a build with -DATTN_RB=1), each in its own process, alternated.

    .venv/bin/python benchmarks/bench_attention.py [--rounds 4]                 # the kernel alone
    .venv/bin/python benchmarks/bench_attention.py --model M.coli [--after 1500] [--lengths 128 256]
    .venv/bin/python benchmarks/bench_attention.py --kv [--rounds 4]            # quantized KV caches

The kernel: `native_attn.attn_rows` for 64 rows over 300 or 1500 cached positions (16 heads of 64; 16 query
heads on 4 KV heads of 128), median of 15 calls per process. With --model: the time to first token of a
prompt whose first --after tokens a slot already holds and --lengths new ones (median of 3 per process),
what a chat turn deep in a conversation costs. Prints each build's median over the rounds, the ratio
and the load average. Both builds give the same bits (tests/test_native.py).

--kv: one build, the caches' row types (kernels/kvq.c) side by side: `native_attn.attn_decode` (one query row, 16 heads
of 64 on 16 KV heads) over 8192 and 32768 positions, and `native_attn.attn_rows` for a 64-row prompt chunk over 8192,
with K and V both bf16, q8_0 or q4_0; 2 threads, the types interleaved in each round, the median of all calls
(25 a round; 3 for the chunk). Prints ms, each type's ratio to bf16 and the load average.
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

BUILDS = {"one row at a time": "-DATTN_RB=1", "rows in blocks": ""}


def kernel() -> dict:
    import torch

    from colibri.kernels import native, native_attn

    native.set_threads(2)
    torch.set_num_threads(1)
    out = {}
    for D, Hkv, ctx in ((64, 16, 1500), (64, 16, 300), (128, 4, 1500)):
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(Hkv, ctx + 64, D, generator=g).bfloat16() for _ in range(2))
        q = torch.randn(64, 16, D, generator=g).bfloat16()
        S = [ctx + t + 1 for t in range(64)]
        ts = []
        for i in range(18):
            t0 = time.perf_counter()
            native_attn.attn_rows(q, [k] * 64, [v] * 64, S, 0.125)
            if i >= 3:  # (warm-up)
                ts.append(time.perf_counter() - t0)
        out[f"64 rows, 16 heads of {D} on {Hkv} KV heads, {ctx} positions (ms)"] = statistics.median(ts) * 1e3
    return out


def kv_types(rounds: int) -> None:
    import torch

    from colibri.kernels import native, native_attn

    native.set_threads(2)
    torch.set_num_threads(1)
    types = {"bf16": native_attn.KV_BF16, "q8_0": native_attn.KV_Q8_0, "q4_0": native_attn.KV_Q4_0}
    Hkv, D = 16, 64
    load0 = os.getloadavg()[0]
    for ctx, rows, calls in ((8192, 1, 25), (32768, 1, 25), (8192, 64, 3)):
        g = torch.Generator().manual_seed(ctx)
        k, v = (torch.randn(Hkv * ctx, D, generator=g).bfloat16() for _ in range(2))
        q = torch.randn(rows, 16, D, generator=g).bfloat16()
        caches = {name: tuple(x.view(Hkv, ctx, D) if t == native_attn.KV_BF16 else
                              native_attn.kv_quantize(x, t).view(Hkv, ctx, -1) for x in (k, v))
                  for name, t in types.items()}
        S = [ctx - rows + r + 1 for r in range(rows)]  # a chunk's causal rows (one row: all positions)
        ts: dict[str, list[float]] = {name: [] for name in types}
        for _ in range(rounds):
            for name, t in types.items():
                kc, vc = caches[name]
                for i in range(calls + 1):
                    t0 = time.perf_counter()
                    if rows == 1:
                        native_attn.attn_decode(q[0], kc, vc, 0.125, kvt=t | t << 4, Dv=D)
                    else:
                        native_attn.attn_rows(q, [kc] * rows, [vc] * rows, S, 0.125, kvt=t | t << 4, Dv=D)
                    if i:  # (the first call warms up)
                        ts[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(x) * 1e3 for name, x in ts.items()}
        what = "one row" if rows == 1 else f"{rows} rows (attn_rows)"
        print(f"{what}, 16 heads of {D} on {Hkv} KV heads, {ctx} positions: "
              + ", ".join(f"{n} {m:.3f} ms ({m / med['bf16']:.2f}x)" for n, m in med.items()))
    print(f"{rounds} interleaved rounds, medians; load {load0:.1f} -> {os.getloadavg()[0]:.1f}")


def engine(model: str, after: int, lengths: list[int]) -> dict:
    import colibri

    llm = colibri.load(model, ctx_size=after + max(lengths) + 16, threads=2)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    rng = random.Random(0)
    base = [1] + [rng.randrange(3, 384) for _ in range(after - 1)]  # ids the test tokenizer has
    list(llm.generate_ids(base, 1, ignore_eos=True))
    out = {}
    for n in lengths:
        ts = []
        for _ in range(3):
            h = llm.submit(base + [rng.randrange(3, 384) for _ in range(n)], 1, ignore_eos=True)
            h.wait()
            ts.append(h.stats.ttft_s)
        out[f"{n} new rows after {after} (TTFT ms)"] = statistics.median(ts) * 1e3
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--after", type=int, default=1500)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv", action="store_true", help="the KV cache's row types, one build")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.kv:
        kv_types(a.rounds)
        return
    if a.worker:
        print(json.dumps(engine(a.model, a.after, a.lengths) if a.model else kernel()))
        return
    runs: dict[str, list[dict]] = {name: [] for name in BUILDS}
    load0 = os.getloadavg()[0]
    args = [sys.executable, __file__, "--worker", "--after", str(a.after), "--lengths", *map(str, a.lengths)]
    args += ["--model", a.model] if a.model else []
    for r in range(a.rounds):
        for name, flags in list(BUILDS.items())[:: 1 if r % 2 == 0 else -1]:
            p = subprocess.run(args, env={**os.environ, "COLIBRI_NATIVE_CFLAGS": flags}, capture_output=True,
                               text=True, check=True)
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    one, blocks = runs.values()
    print(f"{a.rounds} alternated rounds per build, medians; load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    for key in one[0]:
        x, y = statistics.median(r[key] for r in one), statistics.median(r[key] for r in blocks)
        print(f"  {key}: one row at a time {x:.2f}, rows in blocks {y:.2f}: {x / y:.2f}x")


if __name__ == "__main__":
    main()
