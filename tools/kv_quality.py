"""Measure the KV-cache quality table of docs/QUANT.md: the demo model with each K/V cache type against the bf16 cache.

    .venv/bin/python tools/kv_quality.py [--out /tmp/colibri-kv] [--ctx 1024] [--threads 2]

The evaluation text is tools/quant_table.py's (stories the demo never saw in training). Each container (bf16 and int8,
converted from colibri/data/demo once) is scored with `colibri.analysis.perplexity.perplexity` in windows of --ctx
tokens every --ctx / 2 (the demo's longest context is 1024) with each K/V type, KL against the same container with
the default bf16 cache: what the cache's quantization alone costs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import quant_table  # noqa: E402

from colibri.analysis.perplexity import perplexity  # noqa: E402
from colibri.api import Engine  # noqa: E402
from colibri.convert.converter import convert  # noqa: E402
from colibri.demo import DEMO_HF  # noqa: E402

TYPES = [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")]  # (K, V); each against (bf16, bf16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/colibri-kv"))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schemes", nargs="+", default=["bf16", "int8"])
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    text = quant_table.texts(a.out)[0].read_text()
    t0 = time.time()
    print(f"demo model, windows of {a.ctx} every {a.ctx // 2}, KL against the same container's bf16 K/V cache "
          f"(torch {__import__('torch').__version__}, {platform.machine()}, {os.cpu_count()} CPUs)\n")
    print("| weights | K cache | V cache | KV bytes / position | perplexity | KL (mean) | KL p99 | top-1 | PPL ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for scheme in a.schemes:
        path = a.out / f"demo-{scheme}.coli"
        if not path.exists():
            convert(DEMO_HF, path, scheme, 64, progress=False)
        base = Engine(path, ctx_size=a.ctx, threads=a.threads, slots=4)
        try:
            for k, v in TYPES:
                with Engine(path, ctx_size=a.ctx, threads=a.threads, slots=4, kv_type=(k, v)) as eng:
                    r = perplexity(eng, text, a.ctx, a.ctx // 2, base, progress=False)
                    per_pos = eng.kv_bytes() // (eng.n_slots * a.ctx)
                kl = r.kl
                print(f"| {scheme} | {k} | {v} | {per_pos} (bf16: {base.kv_bytes() // (4 * a.ctx)}) | {r.ppl:.4f} | "
                      f"{kl.mean_kl:.5f} | {kl.p99_kl:.4f} | {kl.top1_agreement:.2%} | {kl.ppl_ratio:.4f} |",
                      flush=True)
        finally:
            base.close()
    print(f"\n({r.tokens_scored} tokens scored a row in {r.windows} windows; {time.time() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
