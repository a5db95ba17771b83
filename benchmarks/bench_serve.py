"""`colibri serve` next to `llama-server`: concurrent streaming chat completions, same model, same run.

    .venv/bin/python benchmarks/bench_serve.py [--shape 0.44b] [--scheme int8] [--clients 1 2 4 8]
        [--tokens 64] [--threads 2] [--workdir /tmp/colibri-bench] [--memcap 3500M]

Same checkpoint and converters as bench_vs_llamacpp.py (int8 .coli vs Q8_0 GGUF, int4 vs Q4_0;
llama.cpp built from the llama-cpp-python sdist by benchmarks/llamacpp.py). Each server runs
alone on a free 127.0.0.1 port with as many slots as the largest client count (`--slots N` /
`-np N`), gets one warm-up request, then for each N in --clients receives N concurrent streaming
/v1/chat/completions requests (official openai client, greedy or `--sample T P K` = temperature T, top_p P,
top_k K with a seed per request, --tokens tokens each,
`ignore_eos` so every request generates them all) and is stopped. Printed per N and server:
aggregate tok/s (all completion tokens / wall time from the first request sent to the last
token), TTFT p50/p95, inter-token latency p50/p95 (gaps between streamed token chunks, empty ones
included: a token whose text is not complete yet still gets its chunk from colibri), per-request tok/s (median of
completion tokens / time from sending to the last token), the ratio colibri / llama-server
and the load average. --memcap LIMIT runs each server inside
`memcap LIMIT` (../shared/tools next to the checkout) after evicting its model file from the
page cache, with --mem-budget for colibri (bench_vs_llamacpp.BUDGET) and mmap for llama.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llamacpp  # noqa: E402  (benchmarks/ is not a package)
from bench_vs_llamacpp import BUDGET, GGUF_TYPE, SHAPES, TOOLS, evict, prepare, shared_tools  # noqa: E402

PROMPTS = ["Tell me a story about a little girl and a dog.", "What is the capital of France?",
           "Write a short poem about the river.", "How much wood would a woodchuck chuck?",
           "Can you tell me a story about the village?", "What is two plus two?",
           "Describe the forest in winter.", "Who came to the village with a cart full of books?"]


def cache_servers(a: argparse.Namespace, coli: Path, gguf: Path, bin_dir: Path, slots: int, ctx: int) -> dict:
    """colibri serve with and without prompt caching, and llama-server: name -> (port -> command)."""
    ccmd = [sys.executable, "-m", "colibri", "serve", "--model", str(coli), "--slots", str(slots), "--threads",
            str(a.threads), "--ctx-size", str(ctx), "--spec", "off"]  # (llama-server drafts nothing either)
    return {"colibri": lambda p: ccmd + ["--port", str(p)],
            "colibri no-cache": lambda p: ccmd + ["--no-cache-prompt", "--port", str(p)],
            "llama-server": lambda p: llamacpp.server_cmd(bin_dir, gguf, p, a.threads, slots, ctx)}


def each_server(servers: dict, workdir: Path, tag: str, job) -> dict:
    """Start each server alone on a free port, `job(base_url)` once it is ready, stop it: name -> result."""
    results = {}
    for name, make in servers.items():
        port = free_port()
        srv = Server(name, make(port), port, workdir / f"{tag}-{name.replace(' ', '-')}.log", None)
        try:
            srv.wait_ready()
            results[name] = job(srv.base)
        finally:
            srv.stop()
        print(f"  {name} done", file=sys.stderr, flush=True)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (its own process group, so a memcap wrapper and its child stop together)."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, cap: str | None):
        self.name, self.port, self.capped = name, port, bool(cap)
        if cap:
            cmd = [str(TOOLS / "memcap"), cap, *cmd]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 600) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while loading
            time.sleep(0.5)
        raise SystemExit(f"{self.name} not ready after {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        """SIGINT to the server itself; under memcap, to memcap's child only, so that memcap's
        shell lives on to print the cgroup's peak and remove the cgroup."""
        if self.proc.poll() is None:
            for pid in _group(self.proc.pid) if self.capped else [self.proc.pid]:
                os.kill(pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _group(pgid: int) -> list[int]:
    """Processes of process group `pgid` other than its leader (from /proc/PID/stat field 5)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != pgid:
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(int(d.name))
    return out


SAMPLE: dict = {"temperature": 0}  # --sample: temperature, top_p, extra_body top_k (and a seed per request)


async def one_request(client, model: str, prompt: str, tokens: int, seed: int) -> dict:
    """One streamed chat completion: send time, token arrival times, completion tokens."""
    t0 = time.perf_counter()
    times, usage = [], None
    kw = dict(SAMPLE)
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, seed=seed,
        stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw)
    async for chunk in stream:
        c = chunk.choices[0] if chunk.choices else None
        # A token's chunk: content, even empty (colibri sends one per token while a character or a
        # possible stop string is incomplete, and for the 7B shape's random ids beyond the small test
        # tokenizer, which decode to nothing); not the role chunk, not an empty closing chunk.
        if c is not None and c.delta.content is not None and c.delta.role is None \
                and (c.delta.content or c.finish_reason is None):
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    # t_end: the aggregate's end when no token chunk came at all
    return {"t0": t0, "times": times, "t_end": time.perf_counter(),
            "tokens": usage if usage is not None else len(times)}


_sent = 0  # requests sent so far: numbers every prompt, so no server reuses a cached prefix


async def burst(base: str, n: int, tokens: int) -> list[dict]:
    from openai import AsyncOpenAI

    global _sent
    prompts = [f"Request {_sent + i}. {PROMPTS[(_sent + i) % len(PROMPTS)]}" for i in range(n)]
    _sent += n
    async with AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        model = (await client.models.list()).data[0].id  # the id each server gives its model
        return await asyncio.gather(*(one_request(client, model, p, tokens, _sent - n + i)
                                      for i, p in enumerate(prompts)))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(rs: list[dict]) -> dict:
    """Aggregate tok/s, TTFT and inter-token latency percentiles of one burst."""
    start = min(r["t0"] for r in rs)
    end = max(r["times"][-1] if r["times"] else r["t_end"] for r in rs)
    ttft = [(r["times"][0] - r["t0"]) * 1e3 for r in rs if r["times"]]
    # Gaps between streamed chunks: a chunk holds several tokens when a token ends mid-character
    # (random models emit raw bytes), so tokens come from `usage`, not from counting chunks.
    itl = [(b - a) * 1e3 for r in rs for a, b in zip(r["times"], r["times"][1:])]
    per = [r["tokens"] / ((r["times"][-1] if r["times"] else r["t_end"]) - r["t0"]) for r in rs]  # one client
    return {"agg_tok_s": sum(r["tokens"] for r in rs) / (end - start), "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p95_ms": _pct(ttft, 0.95), "itl_p50_ms": _pct(itl, 0.5), "itl_p95_ms": _pct(itl, 0.95),
            "req_tok_s_p50": _pct(per, 0.5), "tokens": sum(r["tokens"] for r in rs), "load": os.getloadavg()[0]}


def bench_server(srv: Server, clients: list[int], tokens: int) -> dict[int, dict]:
    try:
        srv.wait_ready()
        asyncio.run(burst(srv.base, 1, 8))  # warm-up: first-request allocations, page faults
        out = {}
        for n in clients:
            out[n] = summarize(asyncio.run(burst(srv.base, n, tokens)))
            print(f"  {srv.name}: {n} clients done", file=sys.stderr, flush=True)
        return out
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.44b")
    ap.add_argument("--scheme", choices=sorted(GGUF_TYPE), default="int8")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    ap.add_argument("--sample", type=float, nargs=3, metavar=("T", "P", "K"), default=None,
                    help="sample with temperature T, top_p P, top_k K (0: off) instead of greedy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-per-slot", type=int, default=256)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/colibri-bench"))
    ap.add_argument("--memcap", default=None, help="run each server inside `memcap MEMCAP`, cold page cache")
    ap.add_argument("--mem-budget", default=None, help="colibri --mem-budget under --memcap (default per scheme)")
    a = ap.parse_args()
    if a.sample:
        SAMPLE.update(temperature=a.sample[0], top_p=a.sample[1], extra_body={"top_k": int(a.sample[2])})
    if a.memcap and shared_tools() is None:
        raise SystemExit(f"--memcap: no memcap/evict in {TOOLS}")
    cache = a.workdir / "llamacpp"
    bin_dir = llamacpp.build(cache)
    _, colis, ggufs = prepare(a.shape, a.workdir, [a.scheme], cache)
    coli, gguf = colis[a.scheme], ggufs[a.scheme]
    slots = max(a.clients)
    ccmd = [sys.executable, "-m", "colibri", "serve", "--model", str(coli), "--slots", str(slots),
            "--threads", str(a.threads), "--ctx-size", str(a.ctx_per_slot), "--max-queue", str(4 * slots),
            "--spec", "off"]  # (llama-server drafts nothing either)
    if a.memcap:
        ccmd += ["--mem-budget", a.mem_budget or BUDGET[a.scheme]]
    results = {}
    for name, path, make in (
            (f"colibri {a.scheme}", coli, lambda p: ccmd + ["--port", str(p)]),
            (f"llama-server {GGUF_TYPE[a.scheme].upper()}", gguf,
             lambda p: llamacpp.server_cmd(bin_dir, gguf, p, a.threads, slots, a.ctx_per_slot))):
        if a.memcap:
            evict(path)
        port = free_port()
        log = a.workdir / f"bench_serve-{name.split()[0]}.log"
        results[name] = bench_server(Server(name, make(port), port, log, a.memcap), a.clients, a.tokens)
    cname, lname = list(results)
    where = f"memcap {a.memcap}, cold page cache" if a.memcap else "in RAM"
    how = f"sampled (temperature {a.sample[0]:g}, top_p {a.sample[1]:g}, top_k {a.sample[2]:g})" if a.sample \
        else "greedy"
    print(f"shape {a.shape}, {a.scheme} vs {GGUF_TYPE[a.scheme].upper()}, {where}; {a.threads} threads, {slots} "
          f"slots each, {a.tokens} tokens per request, streaming chat completions, {how}, ignore_eos")
    print(f"{'N':>3} {'server':<20}{'agg tok/s':>10}{'TTFT p50':>10}{'p95':>8}{'ITL p50':>9}{'p95':>8}"
          f"{'req tok/s':>10}{'load':>6}")
    for n in a.clients:
        for name in (cname, lname):
            r = results[name][n]
            print(f"{n:>3} {name:<20}{r['agg_tok_s']:>10.1f}{_ms(r['ttft_p50_ms']):>10}{_ms(r['ttft_p95_ms']):>8}"
                  f"{_ms(r['itl_p50_ms']):>9}{_ms(r['itl_p95_ms']):>8}{_f(r['req_tok_s_p50']):>10}{r['load']:>6.1f}")
        c, ll = results[cname][n], results[lname][n]
        print(f"{'':>3} {'ratio colibri/llama':<20}{c['agg_tok_s'] / ll['agg_tok_s']:>9.2f}x"
              f"{_x(c['ttft_p50_ms'], ll['ttft_p50_ms']):>10}{'':>8}{_x(c['itl_p50_ms'], ll['itl_p50_ms']):>9}"
              f"{'':>8}{_x(c['req_tok_s_p50'], ll['req_tok_s_p50']):>10}")
    if a.memcap:
        for name in (cname, lname):
            log = (a.workdir / f"bench_serve-{name.split()[0]}.log").read_text()
            peak = [line for line in log.splitlines() if line.startswith("memcap: limit")]
            print(f"{name}: {peak[-1] if peak else 'no memcap summary in its log'}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}ms"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


if __name__ == "__main__":
    main()
