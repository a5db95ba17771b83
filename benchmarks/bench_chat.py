"""A growing conversation: time to first token per turn, colibri with and without prompt caching and
llama-server (its `cache_prompt` is on by default), same model, same run.

    .venv/bin/python benchmarks/bench_chat.py [--shape 0.44b] [--scheme int8] [--turns 8]
        [--answer 32] [--threads 2] [--workdir /tmp/colibri-bench]

Same checkpoint and converters as bench_vs_llamacpp.py. Each server runs alone on a free
127.0.0.1 port with one slot, gets one warm-up request, then one client holds a conversation:
every turn sends the whole history (its own earlier answers included, as chat clients do) plus a
new user message of ~60 words, and streams a greedy answer of --answer tokens (`ignore_eos`).
Printed per turn: prompt tokens (from `usage`), the cached ones (colibri's
`usage.prompt_tokens_details.cached_tokens`), TTFT per server, the ratios and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serve import cache_servers, each_server  # noqa: E402
from bench_vs_llamacpp import GGUF_TYPE, add_model_args, model_pair  # noqa: E402

MESSAGE = ("Tell me more about the village by the river, the old mill, the baker and his daughter, the "
           "market on Sundays, the bridge that the children cross on their way to school, the forest "
           "behind the hills and the animals that live there, and what happened when the winter came. "
           "Turn {}.")


def converse(base: str, turns: int, answer: int, message: str = MESSAGE) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    history: list[dict] = []
    out = []
    for t in range(turns):
        history.append({"role": "user", "content": message.format(t + 1)})
        t0 = time.perf_counter()
        first, text, usage = None, [], None
        stream = client.chat.completions.create(model=model, messages=history, max_tokens=answer, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content is not None and chunk.choices[0].delta.role is None:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        history.append({"role": "assistant", "content": "".join(text)})
        details = getattr(usage, "prompt_tokens_details", None)
        out.append({"prompt": usage.prompt_tokens if usage else None,
                    "cached": getattr(details, "cached_tokens", None) if details else None,
                    "ttft_ms": ((first or time.perf_counter()) - t0) * 1e3, "load": os.getloadavg()[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer")
    a = ap.parse_args()
    bin_dir, coli, gguf = model_pair(a)
    ctx = 320 * a.turns + 512  # the test tokenizer (384 ids) spends ~200 tokens on a user message

    def job(base: str) -> list[dict]:
        converse(base, 1, 4, "Say hello {}.")  # warm-up: shares only the template's start
        return converse(base, a.turns, a.answer)

    results = each_server(cache_servers(a, coli, gguf, bin_dir, 1, ctx), a.workdir, "bench_chat", job)
    print(f"shape {a.shape}, {a.scheme} vs {GGUF_TYPE[a.scheme].upper()}, in RAM; {a.threads} threads, one slot; "
          f"{a.turns} turns, {a.answer}-token greedy answers; TTFT in ms")
    c, n, ll = results["colibri"], results["colibri no-cache"], results["llama-server"]
    print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'colibri':>9}{'no-cache':>10}{'llama':>8}{'llama prompt':>14}"
          f"{'no-cache/colibri':>18}{'colibri/llama':>15}{'load':>6}")
    for t in range(a.turns):
        print(f"{t + 1:>4}{c[t]['prompt']:>8}{c[t]['cached']:>8}{c[t]['ttft_ms']:>9.0f}{n[t]['ttft_ms']:>10.0f}"
              f"{ll[t]['ttft_ms']:>8.0f}{ll[t]['prompt']:>14}{n[t]['ttft_ms'] / c[t]['ttft_ms']:>17.2f}x"
              f"{c[t]['ttft_ms'] / ll[t]['ttft_ms']:>14.2f}x{c[t]['load']:>6.1f}")


if __name__ == "__main__":
    main()
