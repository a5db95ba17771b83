"""Per-family table: logit max-abs-diff vs transformers (f32), greedy match length, int8 decode tok/s.

    .venv/bin/python benchmarks/bench_families.py [--threads 2] [--tokens 64] [--workdir /tmp/colibri-families]

Uses the tiny random checkpoints of tests/hf_tiny.py (hidden 64, 3-4 layers) — the oracle models —
so the decode figure is dominated by per-token overhead, not by weight bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_tiny import hf_greedy, hf_logits, load_hf, make_tiny_checkpoint  # noqa: E402

import colibri  # noqa: E402
from colibri.convert.converter import convert  # noqa: E402
from colibri.models.family import supported  # noqa: E402

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--greedy", type=int, default=40)
    p.add_argument("--workdir", default="/tmp/colibri-families")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    root = Path(a.workdir)
    print(f"{'family':12s} {'max|dlogit|':>12s} {'greedy match':>13s} {'int8 decode tok/s':>18s}")
    for mt in supported():
        src = make_tiny_checkpoint(mt, root / mt)
        f32 = convert(src, root / f"{mt}.f32.coli", "f32", progress=False)
        int8 = convert(src, root / f"{mt}.int8.coli", "int8", group_size=32, progress=False)
        hf = load_hf(src)
        llm = colibri.load(f32, ctx_size=256, threads=a.threads)
        llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
        ids = PROMPT * 3
        diff = (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item()
        ours = list(llm.generate_ids(PROMPT, a.greedy, ignore_eos=True))
        ref = hf_greedy(hf, PROMPT, a.greedy)
        match = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), a.greedy)
        q = colibri.load(int8, ctx_size=256, threads=a.threads)
        q.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
        list(q.generate_ids(PROMPT, 8, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        list(q.generate_ids(PROMPT, a.tokens, ignore_eos=True))
        tps = q.last_stats.decode_tps
        print(f"{mt:12s} {diff:12.2e} {match:>6d}/{a.greedy:<6d} {tps:18.1f}   ({time.perf_counter() - t0:.2f}s)")


if __name__ == "__main__":
    main()
