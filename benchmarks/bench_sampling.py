"""Token sampling: colibri's sampler next to transformers' logits warpers, and what it costs a batch.

    .venv/bin/python benchmarks/bench_sampling.py [--vocab 32000 50304 152064] [--model M.coli] [--threads 2]

1. Per logits row, the time to pick one token under common settings (temperature alone; top_k 40;
   top_p 0.95; llama.cpp's defaults top_k 40 + top_p 0.95 + min_p 0.05), for colibri
   (colibri/engine/sampling.py: candidates by a top-64 grown as needed, one uniform against their
   cumulative sum) and for transformers in the same run (its Temperature/TopK/TopP/MinP warpers, then
   torch.multinomial, as `generate(do_sample=True)` does). Two kinds of rows per vocabulary size: a
   peaked one (a trained model's typical step: logits N(0, 1) plus a few tokens 8-12 above) and a flat
   one (N(0, 1) scaled by 3: the nucleus holds thousands of tokens, the sampler's worst case).
2. With --model (default: bench_batch's 32k-vocabulary 0.44B model when present): generate_batch of
   1 and 8 requests, 64 tokens each, greedy vs sampled (temperature 0.8, top_p 0.95, seeded) vs Ollama's
   defaults (server/ollama.py: temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64
   tokens), aggregate tok/s, 3 rounds interleaved, each setting's median; the load average with each figure.
   `--batch-only` skips part 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from colibri.engine.sampling import make_sampler

SETTINGS = {  # name -> (temperature, top_k, top_p, min_p)
    "temperature 0.8": (0.8, 0, 1.0, 0.0),
    "top_k 40": (0.8, 40, 1.0, 0.0),
    "top_p 0.95": (0.8, 0, 0.95, 0.0),
    "k40 p0.95 min_p0.05": (0.8, 40, 0.95, 0.05),
}


def hf_sampler(temperature: float, top_k: int, top_p: float, min_p: float,
               g: torch.Generator) -> Callable[[torch.Tensor], int]:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    ids = torch.zeros(1, 1, dtype=torch.long)

    def sample(logits: torch.Tensor) -> int:
        probs = torch.softmax(warpers(ids, logits[None]), -1)
        return int(torch.multinomial(probs, 1, generator=g))

    return sample


def per_call_us(fn: Callable[[], object], min_s: float = 0.3) -> float:
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def rows(V: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    peaked = torch.randn(V, generator=g)
    peaked[torch.randint(0, V, (5,), generator=g)] += torch.tensor([12.0, 11.0, 10.0, 9.0, 8.0])
    return {"peaked": peaked, "flat": torch.randn(V, generator=g) * 3}


def sampler_table(vocabs: list[int]) -> None:
    print(f"per row, us (load {os.getloadavg()[0]:.1f})")
    print(f"{'vocab':>7} {'row':<7} {'setting':<22}{'colibri':>9}{'transformers':>14}{'ratio':>8}")
    for V in vocabs:
        for kind, z in rows(V, torch.Generator().manual_seed(V)).items():
            for name, (t, k, p, mp) in SETTINGS.items():
                ours = make_sampler(t, k, p, torch.Generator().manual_seed(0), mp)
                peer = hf_sampler(t, k, p, mp, torch.Generator().manual_seed(0))
                a = per_call_us(lambda f=ours, x=z: f(x))
                b = per_call_us(lambda f=peer, x=z: f(x))
                print(f"{V:>7} {kind:<7} {name:<22}{a:>9.0f}{b:>14.0f}{b / a:>7.1f}x")
    print(f"(ratio: transformers' time / colibri's; load after {os.getloadavg()[0]:.1f})")


def batch_table(model: Path, threads: int) -> None:
    import colibri

    llm = colibri.load(str(model), slots=8, threads=threads)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    prompts = [f"Request {i}: tell me a story." for i in range(8)]
    runs: dict[tuple[str, int], list[float]] = {}
    settings = {"greedy": {"temperature": 0.0}, "t0.8 top_p0.95": {"temperature": 0.8, "top_p": 0.95, "seed": 1},
                "ollama": {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 64,
                           "seed": 1}}
    for _ in range(3):
        for name, kw in settings.items():
            for n in (1, 8):
                t = time.perf_counter()
                llm.generate_batch(prompts[:n], max_tokens=64, ignore_eos=True, **kw)
                runs.setdefault((name, n), []).append(n * 64 / (time.perf_counter() - t))
    llm.close()
    print(f"\n{model.name}: generate_batch, 64 tokens per request, aggregate tok/s (median of 3; load "
          f"{os.getloadavg()[0]:.1f})")
    for n in (1, 8):
        g, s = statistics.median(runs[("greedy", n)]), statistics.median(runs[("t0.8 top_p0.95", n)])
        o = statistics.median(runs[("ollama", n)])
        print(f"  N={n}: greedy {g:.1f}, sampled {s:.1f} ({s / g:.2f}x greedy), Ollama's defaults {o:.1f} "
              f"({o / g:.2f}x greedy)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 50304, 152064])
    ap.add_argument("--model", type=Path, default=Path("/tmp/colibri-bench/olmoe-0.44b-v32k.int8.coli"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-only", action="store_true", help="only part 2 (generate_batch)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not a.batch_only:
        sampler_table(a.vocab)
    if a.model.exists():
        batch_table(a.model, a.threads)
    else:
        print(f"\n(no {a.model}: run benchmarks/bench_batch.py once to make it, or pass --model)")


if __name__ == "__main__":
    main()
