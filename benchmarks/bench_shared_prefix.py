"""Requests that arrive together with one long system prompt: colibri (the shared prefix prefilled once,
then copied), colibri without prompt caching (each request prefills it) and llama-server, same run.

    .venv/bin/python benchmarks/bench_shared_prefix.py [--shape 0.44b] [--scheme int8] [--clients 4]
        [--system-words 300] [--answer 16] [--rounds 2] [--threads 2] [--workdir /tmp/colibri-bench]

Same checkpoint and converters as bench_vs_llamacpp.py. Each server runs alone with --clients slots,
gets one warm-up request, then --rounds times --clients chat requests start together (threads): the
same system prompt of ~--system-words words (a new one each round, so no slot holds it yet) and a
different short user message each, streaming a greedy answer of --answer tokens (`ignore_eos`).
Printed per server: mean and worst TTFT, the time until every answer is complete, the prompt tokens
colibri reports cached, the ratios and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import cache_servers, each_server  # noqa: E402
from bench_vs_llamacpp import GGUF_TYPE, add_model_args, model_pair  # noqa: E402

WORDS = ("river mill baker daughter market bridge school forest hills winter summer garden lantern harbor "
         "boat fisher storm meadow orchard candle letter window station tower").split()


def system_prompt(round_: int, words: int) -> str:
    return f"Round {round_}. You are a storyteller. " + " ".join(WORDS[(i * 7 + round_) % len(WORDS)]
                                                                for i in range(words))


def one(base: str, model: str, system: str, user: str, answer: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    first, usage = None, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=answer, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {"ttft": (first or time.perf_counter()) - t0, "done": time.perf_counter() - t0,
            "prompt": usage.prompt_tokens if usage else 0, "cached": getattr(details, "cached_tokens", 0) or 0}


def burst(base: str, clients: int, round_: int, words: int, answer: int) -> dict:
    from openai import OpenAI

    model = OpenAI(base_url=base + "/v1", api_key="none").models.list().data[0].id
    system = system_prompt(round_, words)
    with ThreadPoolExecutor(clients) as pool:
        rs = list(pool.map(lambda i: one(base, model, system, f"Tell story number {i}.", answer), range(clients)))
    return {"ttft_mean": sum(r["ttft"] for r in rs) / clients, "ttft_max": max(r["ttft"] for r in rs),
            "done": max(r["done"] for r in rs), "prompt": rs[0]["prompt"], "cached": sum(r["cached"] for r in rs),
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--answer", type=int, default=16, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    bin_dir, coli, gguf = model_pair(a)
    ctx = 4 * a.system_words + 256  # the test tokenizer (384 ids) spends ~3 tokens a word

    def job(base: str) -> list[dict]:
        burst(base, 1, -1, 8, 4)  # warm-up
        return [burst(base, a.clients, r, a.system_words, a.answer) for r in range(a.rounds)]

    results = each_server(cache_servers(a, coli, gguf, bin_dir, a.clients, ctx), a.workdir, "bench_shared_prefix", job)
    print(f"shape {a.shape}, {a.scheme} vs {GGUF_TYPE[a.scheme].upper()}, in RAM; {a.threads} threads; {a.clients} "
          f"requests at once with one system prompt of {a.system_words} words, {a.answer}-token greedy answers")
    print(f"{'round':>5} {'server':<17}{'prompt':>7}{'cached':>8}{'TTFT mean':>11}{'TTFT max':>10}{'all done':>10}"
          f"{'vs colibri':>12}{'load':>6}")
    for r in range(a.rounds):
        base = results["colibri"][r]["done"]
        for name, rs in results.items():
            x = rs[r]
            print(f"{r + 1:>5} {name:<17}{x['prompt']:>7}{x['cached']:>8}{x['ttft_mean'] * 1e3:>9.0f}ms"
                  f"{x['ttft_max'] * 1e3:>8.0f}ms{x['done'] * 1e3:>8.0f}ms{x['done'] / base:>11.2f}x{x['load']:>6.1f}")


if __name__ == "__main__":
    main()
