"""Decode speed by thread count and OpenMP wait policy, on a quiet machine and next to a busy process.

    .venv/bin/python benchmarks/bench_threads.py [--model M.coli] [-n 48]

torch's CPU wheel runs its kernels on GNU OpenMP, whose workers spin-wait between parallel regions.
With as many threads as cores and one other busy process, a spinning worker that loses its core
stalls every fork/join (a decode step has hundreds), which is how decode falls 3-10x. For each
setting this runs `colibri bench --json` in a fresh process (OpenMP reads its environment once, at
load) and prints decode tok/s quiet and busy (one extra process spinning on a core), with the ratio
to the best quiet figure and the load average. colibri's default: decode steps run on the native
kernels' own pool (colibri/kernels/pool.c: bounded spin, then sleep), sized 1 or all threads by
timing (colibri/engine/threads.py); prefill steps on torch's OpenMP threads.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys

SETTINGS = [  # (label, threads, extra environment)
    ("2 threads, colibri default", 2, {}),
    ("1 thread", 1, {}),
    ("2 threads, OMP passive", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("2 threads, OMP active (spin)", 2, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ("2 threads, native kernels off (torch + OpenMP)", 2, {"COLIBRI_NATIVE": "0"}),
]


def spin(stop) -> None:
    while not stop.is_set():
        pass


def run(model: str, n: int, threads: int, env: dict) -> float:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "COLIBRI_NATIVE")}
    full.update(env)
    out = subprocess.run([sys.executable, "-m", "colibri", "bench", "--model", model, "-n", str(n),
                          "--threads", str(threads), "--prompts", "1", "--json", "--spec", "off"],
                         env=full, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .coli file (default: the built-in demo, int8)")
    p.add_argument("-n", type=int, default=48, help="tokens to decode per run")
    a = p.parse_args()
    if a.model is None:
        from colibri.demo import demo_model

        a.model = str(demo_model("int8"))
    print(f"model {a.model}, {a.n} tokens, {os.cpu_count()} CPUs")
    rows = []
    for label, threads, env in SETTINGS:
        quiet_load = os.getloadavg()[0]
        quiet = run(a.model, a.n, threads, env)
        stop = mp.Event()
        hog = mp.Process(target=spin, args=(stop,))
        hog.start()
        try:
            busy = run(a.model, a.n, threads, env)
        finally:
            stop.set()
            hog.join()
        rows.append((label, quiet, busy, quiet_load))
    best = max(q for _, q, _, _ in rows)
    print(f"{'setting':36} {'quiet tok/s':>12} {'vs best':>8} {'busy tok/s':>11} {'busy/quiet':>11} {'load':>5}")
    for label, quiet, busy, load in rows:
        print(f"{label:36} {quiet:12.2f} {quiet / best:8.2f} {busy:11.2f} {busy / quiet:11.2f} {load:5.2f}")


if __name__ == "__main__":
    main()
