"""Time QLinear forward per scheme and kernel path against a bf16 F.linear baseline.

    .venv/bin/python benchmarks/bench_quant.py [--threads 2] [--iters 50]

Prints one table: per weight shape [out, in] and activation rows T, the median time per
forward and the ratio to bf16 dense (< 1 = faster). Also times the one-off int4 repack.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from colibri.quant import QLinear, quantize


def _median_ms(fn: Callable[[], object], iters: int, min_s: float = 0.2) -> float:
    for _ in range(3):  # warm-up: first calls pay oneDNN primitive creation
        fn()
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dt = torch.bfloat16
    g = args.group_size
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}, compute {dt}, int4 group {g}")

    cases = [("bf16", "dense"), ("int8", "fused"), ("int8", "dequant"), ("int4", "fused"), ("int4", "dequant"),
             ("int2", "dequant"), ("int3", "dequant")]
    header = f"{'shape [out,in]':>16} {'T':>3} " + " ".join(f"{s + '/' + k:>14}" for s, k in cases)
    print(header)
    print("-" * len(header))
    for shape in [(2048, 1024), (1024, 2048), (4096, 4096)]:
        w = torch.randn(shape) * 0.02
        mods = {(s, k): QLinear.from_dense(w, s, g, None, dt, kernel="auto" if s == "bf16" else k)
                for s, k in cases}
        w_bf16 = w.to(dt)
        for rows in (1, 64):
            x = torch.randn(rows, shape[1], dtype=dt)
            base = _median_ms(lambda x=x: F.linear(x, w_bf16), args.iters)
            cells = []
            with torch.inference_mode():
                for key in cases:
                    m = mods[key]
                    ms = base if key == ("bf16", "dense") else _median_ms(lambda m=m, x=x: m(x), args.iters)
                    cells.append(f"{ms:7.3f} {ms / base:5.2f}x")
            print(f"{str(list(shape)):>16} {rows:>3} " + " ".join(f"{c:>14}" for c in cells))

    print("\nint4 one-off repack at QLinear construction (canonical -> torch CPU packing):")
    for shape in [(2048, 1024), (4096, 4096)]:
        t = quantize(torch.randn(shape) * 0.02, "int4", g)
        ms = _median_ms(lambda t=t, shape=shape: QLinear.from_tensors(t, "int4", shape, g, None, dt), 5, 0.0)
        m = QLinear.from_tensors(t, "int4", shape, g, None, dt)
        print(f"  {list(shape)}: {ms:.2f} ms, allocates {m.nbytes / 2**20:.2f} MiB "
              f"(canonical held by reference: {m.borrowed_nbytes / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
