"""Decode cost of run-time checksum verification, with and without it, in the same run.

    .venv/bin/python benchmarks/bench_verify.py [--model M.coli] [--mem-budget 150M] [--tokens 48] [--rounds 4]

Loads one disk-streamed model under `--mem-budget` (routed experts read from the file into the expert
cache, each record checked with CRC-32C as it lands: colibri/format/integrity.py), then decodes `--tokens`
greedy tokens per round with verification on and off, alternating which goes first so the cache warmth
each inherits evens out; prints decode tok/s per round, the medians, the slowdown, the load average
(the machine may be shared: the figure is noisy), and the cost the checksum itself should have: bytes
checked per token at the CRC-32C speed measured in the same run. Without `--model`, writes a random
OLMoE-shaped 0.44B checkpoint (benchmarks/synth_ckpt.py) and converts it to int8 under --work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_batch import PROMPTS, prepare  # noqa: E402 - the same random 0.44B int8 model and prompts


def crc_gbps() -> float:
    import crc32c

    buf = os.urandom(64 << 20)
    crc32c.crc32c(buf)
    t = time.perf_counter()
    for _ in range(4):
        crc32c.crc32c(buf)
    return 4 * len(buf) / (time.perf_counter() - t) / 1e9


def decode_tps(llm, prompt: str, tokens: int) -> float:
    """Decode tok/s of one greedy generation: tokens after the first over the time since the first."""
    ids = llm.tokenizer.encode(prompt)
    t_first = None
    n = 0
    for n, _ in enumerate(llm.generate_ids(ids, tokens, temperature=0, ignore_eos=True), 1):
        if n == 1:
            t_first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t_first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .coli (default: a random 0.44B int8 model written under --work)")
    ap.add_argument("--work", default="/tmp/colibri-bench-verify")
    ap.add_argument("--mem-budget", default="150M")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    import colibri
    from colibri.store.placement import parse_size

    torch.set_num_threads(a.threads)
    path = Path(a.model) if a.model else prepare(Path(a.work))
    budget = parse_size(a.mem_budget)
    llm = colibri.load(str(path), ctx_size=256, threads=a.threads, mem_budget=budget)
    reader = llm.store.reader
    checks = reader.checks
    s = llm.store_stats()
    print(f"model {path} ({path.stat().st_size / 2**20:.0f} MiB), --mem-budget {a.mem_budget}: {s['placement']}, "
          f"cache {s['cache_slots']} slots, {a.threads} thread(s)")
    decode_tps(llm, PROMPTS[0], 8)  # warm-up: kernels, first reads
    on, off = [], []
    cpu = {"on": 0.0, "off": 0.0}
    v0, b0, c0 = checks.verified, llm.store_stats()["bytes_read"], checks.cpu_s
    for r in range(a.rounds):
        prompt = PROMPTS[(r + 1) % len(PROMPTS)]
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            reader.checks = checks if mode == "on" else None
            t_cpu = time.process_time()
            tps = decode_tps(llm, prompt, a.tokens)
            cpu[mode] += time.process_time() - t_cpu
            (on if mode == "on" else off).append(tps)
            print(f"round {r}  verify {mode:3}  decode {tps:7.2f} tok/s   load average {os.getloadavg()[0]:.2f}")
    reader.checks = checks
    s = llm.store_stats()
    llm.close()
    m_on, m_off = statistics.median(on), statistics.median(off)
    n_tok = a.rounds * a.tokens  # checked rounds only
    per_tok = (checks.verified - v0) / n_tok
    read_per_tok = (s["bytes_read"] - b0) / (2 * n_tok)
    gbps = crc_gbps()
    est = per_tok / (gbps * 1e9) * m_on * 100  # the checksum's share of a token's time, in %
    print(f"median decode: verify on {m_on:.2f} tok/s, off {m_off:.2f} tok/s -> slowdown "
          f"{100 * (1 - m_on / m_off):+.1f}% (noisy: load average {os.getloadavg()[0]:.2f})")
    print(f"checked {per_tok / 2**20:.2f} MiB/token (read {read_per_tok / 2**20:.2f} MiB/token); CRC-32C "
          f"{gbps:.1f} GB/s here (wall) -> expected cost {est:.2f}% of decode time if never overlapped")
    crc_ms = (checks.cpu_s - c0) / n_tok * 1e3
    print(f"CPU per token (all threads, load noise-free): verify on {cpu['on'] / n_tok * 1e3:.1f} ms, off "
          f"{cpu['off'] / n_tok * 1e3:.1f} ms; checksumming {crc_ms:.2f} ms = "
          f"{100 * crc_ms / (cpu['on'] / n_tok * 1e3):.1f}% of the CPU time of a verified token")


if __name__ == "__main__":
    main()
