"""colibri next to llama.cpp, same checkpoint, same run: decode, prefill, peak RSS, RAM bandwidth.

    .venv/bin/python benchmarks/bench_vs_llamacpp.py --shape 0.44b [--schemes int8 int4] [--threads 2]
        [--tokens 64] [--prompt-len 128] [--repeats 3] [--workdir /tmp/colibri-bench]
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --shape 7b --memcap 3500M   # + the capped runs

1. Builds llama.cpp from PyPI's llama-cpp-python sdist (benchmarks/llamacpp.py: GGML_NATIVE=OFF,
   explicit AVX-512/VNNI/BF16, AMX off; once, ~40 min on 2 busy cores, cached in --workdir).
2. Writes one random OLMoE-shaped checkpoint (benchmarks/synth_ckpt.py) and converts it to .coli
   (`colibri convert`, int8 and int4) and to GGUF (the sdist's convert_hf_to_gguf.py: Q8_0; Q4_0
   by llama-quantize). Shapes: 0.44b = hidden 1024, 8 layers, 32 experts top-4, expert width
   512, 16 heads, vocab 384 (the test tokenizer's); 7b = OLMoE-1B-7B (16 layers, 64 experts
   top-8, hidden 2048, expert width 1024, vocab 50304).
3. Per pair (int8 vs Q8_0, int4 vs Q4_0), back to back, each engine in a fresh process:
   decode tok/s over --tokens steps (colibri: after a 1-token prompt; llama-bench: tg, empty
   context), prefill tok/s of a --prompt-len prompt (colibri: prompt / time to first token;
   llama-bench: pp), peak RSS (wait4's ru_maxrss of the process tree), each engine's load
   average, the ratio colibri / llama.cpp, and the decode weight traffic as % of the RAM read
   bandwidth (a plain torch sum over a 1 GiB buffer) measured at the start of the run and again just
   before and just after each engine's run: each engine's % is against its own (the VM's bandwidth
   swings between ~47 and ~75 GB/s; a run whose before and after disagree is flagged).
   `--wait-bandwidth 62` waits before each pair until the bandwidth reads that high: the fast mode
   on purpose (its stretches last seconds to a minute: read the before/after figures).
4. --memcap LIMIT (default for the 7b shape: 3500M): both again inside `memcap LIMIT` after
   `evict` of the model files (cold page cache): colibri with --mem-budget (default per scheme,
   BUDGET), llama.cpp with its default mmap, and again with `--repack 0` if the cap OOM-kills
   it (it repacks Q4_0 into anonymous memory by default). The tools are ../shared/tools next to
   the checkout; without them the capped part says so and is skipped.

No figure is typed in here: every ratio is between two runs of this invocation. The machine's
other work swings every figure: read the load average printed next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import llamacpp  # noqa: E402  (benchmarks/ is not a package)

# Checkpoint shapes (synth_ckpt.write_olmoe overrides; its defaults are OLMoE-1B-7B).
SHAPES = {"0.44b": {"hidden_size": 1024, "num_hidden_layers": 8, "num_experts": 32, "num_experts_per_tok": 4,
                    "intermediate_size": 512, "vocab_size": 384},
          "7b": {}}
GGUF_TYPE = {"int8": "q8_0", "int4": "q4_0"}
# colibri's weight budget under a 3.5 GB cap, per scheme: the process adds ~0.4 GiB (runtime, KV
# cache, activations, mapped pages of dense linears; expert reads bypass the page cache). Measured
# cgroup peaks: int8 2400M -> 2810 MiB, int4 2200M -> 2601 MiB, int4 2900M -> 3317 MiB.
BUDGET = {"int8": "2900M", "int4": "2900M"}
TOOLS = Path(__file__).resolve().parents[2] / "shared" / "tools"  # next to the checkout, on every machine


def shared_tools() -> Path | None:
    """../shared/tools next to the checkout (memcap, evict), or None when absent."""
    return TOOLS if (TOOLS / "memcap").exists() and (TOOLS / "evict").exists() else None


def evict(*paths: Path) -> None:
    tools = shared_tools()
    if tools is not None:
        subprocess.run([str(tools / "evict"), *map(str, paths)], check=True)


# Runs argv[1:] and reports its peak RSS (wait4's ru_maxrss: the largest of it and the
# descendants it waited for, so memcap's shell wrapper reports the engine under it). A small
# fresh process does the reaping because a child forked straight from this one (torch loaded,
# a 1 GiB buffer touched) would start with this process's RSS as its ru_maxrss.
_LAUNCH = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, ru = os.wait4(p.pid, 0)
p.returncode = 0  # reaped above; keeps Popen from waiting again
print(f"peak_rss_kib {ru.ru_maxrss}", file=sys.stderr)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def measured(cmd: list[str], cap: str | None = None, env: dict | None = None) -> dict:
    """Run `cmd` (inside `memcap cap` if given); stdout, exit code, peak RSS, cgroup peak, load."""
    if cap:
        cmd = [str(shared_tools() / "memcap"), cap, *cmd]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _LAUNCH, *cmd], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    r = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "wall_s": time.perf_counter() - t0,
         "load": os.getloadavg()[0]}
    for line in p.stderr.splitlines():
        if line.startswith("memcap: limit"):
            r["cgroup_peak_mib"] = int(line.split("peak ")[1].split()[0])
        elif line.startswith("peak_rss_kib "):
            r["peak_rss_mib"] = int(line.split()[1]) / 1024
    return r


def ram_bandwidth(threads: int, gib: int = 1, reps: int = 5) -> float:
    """GB/s of a plain torch sum over a buffer far larger than the caches (best of `reps`)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(gib << 28)  # f32: gib GiB
    x.sum()
    best = min(_timed(x.sum) for _ in range(reps))
    del x
    return (gib << 30) / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- inputs ------------------------------------------------------------------------------------

def prepare(shape: str, work: Path, schemes: list[str], cache: Path) -> tuple[Path, dict, dict]:
    """The HF checkpoint, {scheme: .coli} and {scheme: .gguf}, each made once."""
    from synth_ckpt import write_olmoe

    hf = work / f"olmoe-{shape}-hf"
    if not (hf / "config.json").exists():
        print(f"writing {hf}", file=sys.stderr, flush=True)
        write_olmoe(hf, progress=False, **SHAPES[shape])
    colis, ggufs = {}, {}
    for s in schemes:
        colis[s] = work / f"olmoe-{shape}.{s}.coli"
        if not colis[s].exists():
            print(f"colibri convert -> {colis[s].name}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "colibri", "convert", "-i", str(hf), "-o", str(colis[s]),
                            "--quant", s, "--no-progress"], check=True, cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        ggufs[s] = llamacpp.to_gguf(hf, work / f"olmoe-{shape}.{GGUF_TYPE[s]}.gguf", GGUF_TYPE[s], cache)
    return hf, colis, ggufs


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--shape, --scheme, --threads, --workdir: one checkpoint for colibri and llama.cpp (the serving benchmarks)."""
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.44b")
    ap.add_argument("--scheme", choices=sorted(GGUF_TYPE), default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/colibri-bench"))


def model_pair(a: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(llama.cpp's bin folder, the .coli, the .gguf) of add_model_args' flags, each made once."""
    cache = a.workdir / "llamacpp"
    bin_dir = llamacpp.build(cache)
    _, colis, ggufs = prepare(a.shape, a.workdir, [a.scheme], cache)
    return bin_dir, colis[a.scheme], ggufs[a.scheme]


def colibri_active_bytes(path: Path) -> int:
    """Weight bytes one decode token reads from a .coli (the planner's accounting)."""
    from colibri.format.container import Container
    from colibri.plan import PlanSizes

    with Container(path) as c:
        s = PlanSizes.from_container(c)
    return sum(s.active_bytes(i) for i in range(s.n_layers)) + s.global_active


# --- one engine run ------------------------------------------------------------------------------

def worker(a: argparse.Namespace) -> dict:
    """In a fresh process: colibri's decode and prefill, timed like llama-bench's tg and pp."""
    import colibri
    from colibri.store.placement import parse_size

    budget = parse_size(a.mem_budget) if a.mem_budget else None
    # No prompt caching: the same prompt is timed again and again (llama-bench's pp computes it each time).
    llm = colibri.load(a.model, ctx_size=a.prompt_len + a.tokens + 8, threads=a.threads, mem_budget=budget,
                       cache_prompt=False)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    rng = random.Random(0)
    prompt = [1] + [rng.randrange(3, 384) for _ in range(a.prompt_len - 1)]  # ids the test tokenizer has
    # Warm-up (llama-bench warms up too): the timed prompt's path (up to 192 tokens: native 64-row
    # steps), and 64 decode steps: the engine times 1 and 2 decode threads over its first ~10 steps
    # or native runs of a few tokens each (engine/threads.py, engine/runner.py), a start-up cost.
    list(llm.generate_ids(prompt[:8], 64, ignore_eos=True))
    list(llm.generate_ids(prompt, 1, ignore_eos=True))
    dec, pre = [], []
    for _ in range(a.repeats):
        it = llm.generate_ids([1], a.tokens + 1, ignore_eos=True)
        next(it)  # the 1-token prompt's forward: not a decode step
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        dec.append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        list(llm.generate_ids(prompt, 1, ignore_eos=True))
        pre.append(a.prompt_len / (time.perf_counter() - t0))
    return {"decode_tok_s": sum(dec) / len(dec), "prefill_tok_s": sum(pre) / len(pre)}


def run_colibri(model: Path, a: argparse.Namespace, cap: str | None = None, budget: str | None = None,
                repeats: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--threads", str(a.threads),
           "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--repeats", str(repeats or a.repeats)]
    if budget:
        cmd += ["--mem-budget", budget]
    r = measured(cmd, cap, env={"PYTHONPATH": str(ROOT)})
    if r["rc"] == 0:
        r.update(json.loads(r["stdout"].strip().splitlines()[-1]))
    return r


def run_llama(bin_dir: Path, gguf: Path, a: argparse.Namespace, cap: str | None = None,
              repeats: int | None = None, repack: bool = True) -> dict:
    cmd = llamacpp.bench_cmd(bin_dir, gguf, a.threads, a.prompt_len, a.tokens, repeats or a.repeats, repack)
    r = measured(cmd, cap)
    if r["rc"] == 0:
        r.update(llamacpp.parse_bench(r["stdout"]))
    return r


# --- report --------------------------------------------------------------------------------------

def _fmt(r: dict, key: str, spec: str) -> str:
    return format(r[key], spec) if r.get(key) is not None else "-"


def _ratio(c: dict, ll: dict, key: str) -> str:
    return f"{c[key] / ll[key]:.2f}x" if c.get(key) and ll.get(key) else "-"


def table(title: str, c: dict, ll: dict, cname: str, lname: str) -> None:
    print(f"  {title}")
    for r, name in ((c, cname), (ll, lname)):
        if r["rc"] != 0:
            why = "OOM-killed by the cap" if r["rc"] == 137 else f"exit {r['rc']}"
            print(f"    {name} failed ({why}): {r['stderr'].strip()[-600:]}")
    rows = [("decode tok/s", "decode_tok_s", ".2f"), ("prefill tok/s", "prefill_tok_s", ".1f"),
            ("peak RSS MiB", "peak_rss_mib", ".0f")]
    if "cgroup_peak_mib" in c or "cgroup_peak_mib" in ll:
        rows.append(("cgroup peak MiB", "cgroup_peak_mib", "d"))
    w = max(17, len(lname) + 2)
    print(f"    {'':<17}{cname:>14}{'load':>6}{lname:>{w}}{'load':>6}{'ratio':>8}")
    for label, key, spec in rows:
        print(f"    {label:<17}{_fmt(c, key, spec):>14}{c['load']:>6.1f}{_fmt(ll, key, spec):>{w}}"
              f"{ll['load']:>6.1f}{_ratio(c, ll, key):>8}")


def bandwidth_line(name: str, bytes_tok: int, r: dict, bw: float, bw_after: float) -> str:
    if not r.get("decode_tok_s"):
        return f"    {name}: {bytes_tok / 2**20:.1f} MiB of weights per token"
    gbs = bytes_tok * r["decode_tok_s"] / 1e9
    line = (f"    {name}: {bytes_tok / 2**20:.1f} MiB of weights per token x {r['decode_tok_s']:.2f} tok/s = "
            f"{gbs:.2f} GB/s = {gbs / bw:.0%} of the RAM read bandwidth measured just before it ({bw:.1f} GB/s), "
            f"{gbs / bw_after:.0%} of that just after ({bw_after:.1f})")
    if moved(bw, bw_after):
        line += "\n      (the bandwidth moved during this engine's run: its % is not against the bandwidth it ran at)"
    return line


def wait_for_bandwidth(threads: int, gbps: float, timeout_s: float = 600) -> None:
    """Poll the RAM bandwidth every ~2 s until it reads >= gbps (or the timeout passes: said, not fatal)."""
    end = time.time() + timeout_s
    while (bw := ram_bandwidth(threads)) < gbps:
        if time.time() > end:
            print(f"    (no bandwidth reading >= {gbps:.0f} GB/s within {timeout_s:.0f} s; last {bw:.1f}: "
                  "running anyway)")
            return
        time.sleep(2)


def moved(*bws: float) -> bool:
    """Whether bandwidth readings differ by more than 20% (the VM switched between its two modes)."""
    return max(bws) > 1.2 * min(bws)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.44b")
    ap.add_argument("--schemes", nargs="+", default=["int8", "int4"], choices=sorted(GGUF_TYPE))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--prompt-len", type=int, default=128, help="prefill prompt length")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine in RAM (mean); 1 under the cap")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/colibri-bench"))
    ap.add_argument("--llama-cache", type=Path, default=None, help="llama.cpp sdist + build (default WORKDIR/llamacpp)")
    ap.add_argument("--memcap", default=None, help="also run both inside `memcap MEMCAP` from a cold page cache "
                    "(default: 3500M for --shape 7b, none for 0.44b; 'off' to skip)")
    ap.add_argument("--mem-budget", default=None, help="colibri's --mem-budget under the cap (default per scheme: "
                    + ", ".join(f"{k} {v}" for k, v in BUDGET.items()) + ")")
    ap.add_argument("--skip-ram", action="store_true", help="only the capped runs")
    ap.add_argument("--wait-bandwidth", type=float, default=None, metavar="GBPS",
                    help="before each in-RAM pair, wait (up to 10 min) until the RAM bandwidth reads >= GBPS: "
                    "measures the VM's fast mode on purpose")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    cap = a.memcap if a.memcap is not None else ("3500M" if a.shape == "7b" else None)
    cap = None if cap == "off" else cap
    work = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    cache = a.llama_cache or work / "llamacpp"
    bin_dir = llamacpp.build(cache)
    hf, colis, ggufs = prepare(a.shape, work, a.schemes, cache)
    cfg = json.loads((hf / "config.json").read_text())
    load0 = os.getloadavg()[0]
    bw = ram_bandwidth(a.threads)
    print(f"shape {a.shape}: OLMoE-shaped random model, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
          f"layers, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, expert width "
          f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']}; {a.threads} threads; decode {a.tokens} tokens, "
          f"prefill {a.prompt_len}-token prompt; llama.cpp {llamacpp.version(bin_dir)}")
    print(f"RAM read bandwidth (torch sum over 1 GiB f32, {a.threads} threads): {bw:.1f} GB/s  [load {load0:.1f}]",
          flush=True)
    results: dict = {"shape": a.shape, "threads": a.threads, "ram_gbs": bw, "runs": {}}
    for s in a.schemes:
        cname, lname = f"colibri {s}", f"llama.cpp {GGUF_TYPE[s].upper()}"
        cb = colibri_active_bytes(colis[s])
        lb = llamacpp.active_bytes(ggufs[s], cfg["num_experts_per_tok"], cfg["num_experts"], cache)
        if not a.skip_ram:
            # The bandwidth again just before each engine: this VM's memory bandwidth changes with the
            # host's other work (torch's sum read 47-50 or 72-77 GB/s, minutes apart), so a figure taken
            # at the start may not hold for a run minutes later.
            # And just after: a mode switch during a run shows as a before/after pair that disagrees.
            if a.wait_bandwidth:
                wait_for_bandwidth(a.threads, a.wait_bandwidth)
            bw_c = ram_bandwidth(a.threads)
            c = run_colibri(colis[s], a)
            bw_l = ram_bandwidth(a.threads)
            ll = run_llama(bin_dir, ggufs[s], a)
            bw_end = ram_bandwidth(a.threads)
            table(f"{s} vs {GGUF_TYPE[s].upper()}, in RAM (mean of {a.repeats})", c, ll, cname, lname)
            print(bandwidth_line(cname, cb, c, bw_c, bw_l))
            print(bandwidth_line(lname, lb, ll, bw_l, bw_end), flush=True)
            if moved(bw_c, bw_l, bw_end):
                print(f"    (the RAM bandwidth moved during the pair's runs, {bw_c:.1f} -> {bw_l:.1f} -> {bw_end:.1f} "
                      "GB/s: this pair's ratio is not like for like; run it again)", flush=True)
            c["ram_gbs_before"], ll["ram_gbs_before"], ll["ram_gbs_after"] = bw_c, bw_l, bw_end
            results["runs"][f"{s}/ram"] = {"colibri": _clean(c), "llama.cpp": _clean(ll)}
        if cap:
            if shared_tools() is None:
                print(f"  capped runs skipped: no memcap/evict in {TOOLS}")
                continue
            budget = a.mem_budget or BUDGET[s]
            evict(colis[s])
            c = run_colibri(colis[s], a, cap, budget, repeats=1)
            evict(ggufs[s])
            ll = run_llama(bin_dir, ggufs[s], a, cap, repeats=1)
            table(f"{s} vs {GGUF_TYPE[s].upper()}, memcap {cap}, cold page cache (colibri --mem-budget {budget}, "
                  "llama.cpp mmap; 1 run)", c, ll, cname, lname)
            results["runs"][f"{s}/capped"] = {"colibri": _clean(c), "llama.cpp": _clean(ll)}
            if ll["rc"] == 137:
                # llama.cpp's default repacks some types (Q4_0) into anonymous memory: give it the
                # other chance, weights left in the mapping, so the ratio is to its best.
                evict(ggufs[s])
                ll = run_llama(bin_dir, ggufs[s], a, cap, repeats=1, repack=False)
                table(f"{s} vs {GGUF_TYPE[s].upper()}, memcap {cap}, cold page cache, llama.cpp --repack 0 "
                      "(colibri figures from the run above)", c, ll, cname, lname + " --repack 0")
                results["runs"][f"{s}/capped-norepack"] = {"colibri": _clean(c), "llama.cpp": _clean(ll)}
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    (work / f"bench_vs_llamacpp-{a.shape}.json").write_text(json.dumps(results, indent=1))


def _clean(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("stdout", "stderr")}


if __name__ == "__main__":
    main()
