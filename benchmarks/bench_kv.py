"""The quantized KV cache (-ctk/-ctv): decode at a long context next to llama.cpp, and the memory it saves.

    .venv/bin/python benchmarks/bench_kv.py [--part speed memory] [--types bf16 q8_0 q4_0] [--threads 2]
        [--depth 8192] [--tokens 128] [--repeats 3] [--long-ctx 32768] [--slot-ctx 8192] [--slots 4]
        [--workdir /tmp/colibri-bench] [--json OUT]
    .venv/bin/python benchmarks/bench_kv.py --part speed --depth 512 --tokens 16 --repeats 1 --types bf16  # smoke

Model: bench_vs_llamacpp's 0.44b shape (hidden 1024, 8 layers, 32 experts top-4, expert width 512, 16
heads of 64, vocab 384) with max_position_embeddings 40960 so 32k contexts are legal: its own random HF
checkpoint WORKDIR/olmoe-0.44b-long-hf (benchmarks/synth_ckpt.py), an int8 .coli (`colibri convert --quant
int8`) and a Q8_0 GGUF (benchmarks/llamacpp.py, whose cached llama.cpp build it uses), each made once.

1. --part speed: per K/V type (colibri bf16 / q8_0 / q4_0 against llama.cpp f16 / q8_0 / q4_0), back to
   back, each engine in a fresh process, same weights (int8 .coli against Q8_0 .gguf):
   - colibri (this script's --worker speed): load with ctx_size DEPTH + TOKENS + 16, kv_type, cache_prompt
     off; a prompt of DEPTH random ids (3..383, the first 1); warm-up: 64 tokens after an 8-token prompt
     (the engine times 1 against all threads over its first decode steps); then REPEATS times: the DEPTH
     prompt with TOKENS + 1 tokens to generate, prefill tok/s = DEPTH / time to the first token, decode
     tok/s = the other TOKENS / their time (every one at a context of DEPTH and more). Mean of REPEATS.
   - llama.cpp: `llama-bench -m GGUF -t THREADS -p 0 -n TOKENS -d DEPTH -ctk T -ctv T -fa on -r REPEATS
     -o json` (quantized V needs flash attention; the DEPTH prefill is untimed): decode tok/s (avg_ts).
   Table: decode tok/s of each, the ratio colibri / llama.cpp, each run's load average, colibri's prefill
   tok/s and KV bytes, and colibri's (and llama.cpp's) quantized / bf16 (f16) decode ratios: the target
   is q8_0 at least as fast as bf16.
2. --part memory: peak RSS (wait4's ru_maxrss, bench_vs_llamacpp.measured) of a colibri worker that fills
   (a) one slot of LONG_CTX positions (a LONG_CTX - 1 prompt, then 1 token) and (b) SLOTS slots of
   SLOT_CTX (SLOTS different SLOT_CTX - 1 prompts submitted together, then 1 token each), per K/V type,
   with Engine.kv_bytes() from inside the worker; and of one that loads the model with a 16-position
   context and generates 1 token (the baseline: no KV to speak of). Table: peak RSS, RSS - baseline,
   kv_bytes, and both against bf16's. RSS - baseline holds prefill's transient buffers too: read kv_bytes.

No figure is typed in here: every ratio is between two runs of this invocation. The machine's other work
swings every figure: read the load average printed next to it.
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

import bench_vs_llamacpp as vs  # noqa: E402  (benchmarks/ is not a package)
from bench_vs_llamacpp import llamacpp  # noqa: E402

SHAPE = {**vs.SHAPES["0.44b"], "num_attention_heads": 16, "num_key_value_heads": 16}
MAX_POS = 40960
TYPES = {"bf16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}  # colibri's K/V type -> llama.cpp's
VOCAB = SHAPE["vocab_size"]


def prepare(work: Path, cache: Path, gguf: bool) -> tuple[Path, Path, Path | None]:
    """(HF folder, int8 .coli, Q8_0 .gguf or None), each made once."""
    from synth_ckpt import write_olmoe

    hf = work / "olmoe-0.44b-long-hf"
    if not (hf / "config.json").exists():
        print(f"writing {hf}", file=sys.stderr, flush=True)
        tmp = hf.with_name(hf.name + ".tmp")
        write_olmoe(tmp, progress=False, **SHAPE)
        # synth_ckpt's config fixes max_position_embeddings (4096) after the overrides: set it here.
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["max_position_embeddings"] = MAX_POS
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        os.replace(tmp, hf)
    coli = work / "olmoe-0.44b-long.int8.coli"
    if not coli.exists():
        print(f"colibri convert -> {coli.name}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "colibri", "convert", "-i", str(hf), "-o", str(coli),
                        "--quant", "int8", "--no-progress"], check=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    g = llamacpp.to_gguf(hf, work / "olmoe-0.44b-long.q8_0.gguf", "q8_0", cache) if gguf else None
    return hf, coli, g


def _ids(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)]  # ids the test tokenizer has


# --- in a fresh process ----------------------------------------------------------------------------

def worker(a: argparse.Namespace) -> dict:
    import colibri
    from colibri.api import peak_rss_mib

    rng = random.Random(0)
    if a.worker == "speed":
        llm = colibri.load(a.model, ctx_size=a.depth + a.tokens + 16, threads=a.threads, kv_type=a.kv,
                           cache_prompt=False)
        llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
        prompt = _ids(rng, a.depth)
        list(llm.generate_ids(prompt[:8], 64, ignore_eos=True))  # warm-up
        dec, pre = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            it = llm.generate_ids(prompt, a.tokens + 1, ignore_eos=True)
            next(it)  # the prompt's forward: its first token
            t1 = time.perf_counter()
            n = sum(1 for _ in it)
            t2 = time.perf_counter()
            pre.append(a.depth / (t1 - t0))
            dec.append(n / (t2 - t1))
        return {"decode_tok_s": sum(dec) / len(dec), "prefill_tok_s": sum(pre) / len(pre),
                "kv_bytes": llm.kv_bytes(), "kv_types": str(llm.kv_types)}
    if a.worker == "base":
        llm = colibri.load(a.model, ctx_size=16, threads=a.threads, kv_type=a.kv, cache_prompt=False)
        list(llm.generate_ids([1], 1, ignore_eos=True))
    elif a.worker == "long":
        llm = colibri.load(a.model, ctx_size=a.long_ctx, threads=a.threads, kv_type=a.kv, cache_prompt=False)
        list(llm.generate_ids(_ids(rng, a.long_ctx - 1), 1, ignore_eos=True))
    else:  # "slots"
        llm = colibri.load(a.model, ctx_size=a.slot_ctx, threads=a.threads, kv_type=a.kv, slots=a.slots,
                           cache_prompt=False)
        hs = [llm.submit(_ids(rng, a.slot_ctx - 1), 1, ignore_eos=True) for _ in range(a.slots)]
        for h in hs:
            h.wait()
    return {"kv_bytes": llm.kv_bytes(), "kv_types": str(llm.kv_types), "self_peak_rss_mib": peak_rss_mib()}


def _why(r: dict) -> str:
    """Exit status and the last lines of stderr of a failed run (its figures are then left out of the tables)."""
    lines = [x for x in r["stderr"].strip().splitlines() if not x.startswith("peak_rss_kib ")]
    why = {137: "killed (OOM?)", 139: "segmentation fault"}.get(r["rc"], f"exit {r['rc']}")
    return f"{why}: " + " | ".join(x.strip() for x in lines[-2:])


def run_colibri(mode: str, coli: Path, kv: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--model", str(coli), "--kv", kv, "--threads", str(a.threads),
           "--depth", str(a.depth), "--tokens", str(a.tokens), "--repeats", str(a.repeats),
           "--long-ctx", str(a.long_ctx), "--slot-ctx", str(a.slot_ctx), "--slots", str(a.slots)]
    r = vs.measured(cmd, env={"PYTHONPATH": str(ROOT)})
    if r["rc"] == 0:
        r.update(json.loads(r["stdout"].strip().splitlines()[-1]))
    else:
        print(f"    colibri {mode} {kv} failed: {_why(r)}", flush=True)
    return r


def run_llama(bin_dir: Path, gguf: Path, kv: str, a: argparse.Namespace) -> dict:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(a.threads), "-p", "0", "-n", str(a.tokens),
           "-d", str(a.depth), "-ctk", kv, "-ctv", kv, "-fa", "on", "-r", str(a.repeats), "-o", "json"]
    r = vs.measured(cmd)
    if r["rc"] == 0:
        r.update(llamacpp.parse_bench(r["stdout"]))
    else:
        print(f"    llama.cpp {kv} failed: {_why(r)}", flush=True)
    return r


# --- parts -----------------------------------------------------------------------------------------

def _f(r: dict | None, key: str, spec: str) -> str:
    return format(r[key], spec) if r and r.get(key) is not None else "-"


def _div(x: dict | None, y: dict | None, key: str, kx: str | None = None) -> str:
    a, b = (x or {}).get(kx or key), (y or {}).get(key)
    return f"{a / b:.2f}x" if a and b else "-"


def part_speed(a: argparse.Namespace, coli: Path, gguf: Path, bin_dir: Path) -> dict:
    print(f"\ndecode at depth {a.depth}: {a.tokens} tokens after a {a.depth}-token context, mean of {a.repeats} "
          f"(colibri int8 .coli, llama.cpp Q8_0 .gguf, flash attention on)", flush=True)
    out = {}
    for t in a.types:
        c = run_colibri("speed", coli, t, a)
        ll = run_llama(bin_dir, gguf, TYPES[t], a)
        out[t] = {"colibri": _clean(c), "llama.cpp": _clean(ll), "llama_type": TYPES[t]}
    print(f"  {'K/V':<11}{'colibri tok/s':>14}{'load':>6}{'llama.cpp tok/s':>17}{'load':>6}{'ratio':>8}"
          f"{'colibri prefill tok/s':>23}{'colibri KV MiB':>16}")
    for t, r in out.items():
        c, ll = r["colibri"], r["llama.cpp"]
        kv = f"{c['kv_bytes'] / 2**20:.1f}" if c.get("kv_bytes") else "-"
        print(f"  {t + ' / ' + TYPES[t]:<11}{_f(c, 'decode_tok_s', '.2f'):>14}{c['load']:>6.1f}"
              f"{_f(ll, 'decode_tok_s', '.2f'):>17}{ll['load']:>6.1f}{_div(c, ll, 'decode_tok_s'):>8}"
              f"{_f(c, 'prefill_tok_s', '.1f'):>23}{kv:>16}")
    base = out.get("bf16")
    for t in out:
        if base and t != "bf16":
            print(f"  decode {t} / bf16: colibri {_div(out[t]['colibri'], base['colibri'], 'decode_tok_s')}, "
                  f"llama.cpp {t} / f16 {_div(out[t]['llama.cpp'], base['llama.cpp'], 'decode_tok_s')}"
                  + ("  (target: colibri q8_0 >= bf16)" if t == "q8_0" else ""))
    return out


def part_memory(a: argparse.Namespace, coli: Path) -> dict:
    print(f"\npeak RSS of a colibri process filling its KV cache: (a) 1 slot x {a.long_ctx} positions, "
          f"(b) {a.slots} slots x {a.slot_ctx}", flush=True)
    base = run_colibri("base", coli, "bf16", a)
    if base["rc"] != 0:
        base.pop("peak_rss_mib", None)
    print(f"  baseline (16-position context, 1 token): peak RSS {_f(base, 'peak_rss_mib', '.0f')} MiB  "
          f"[load {base['load']:.1f}]")
    out: dict = {"baseline": _clean(base)}
    for mode, label in (("long", f"1 x {a.long_ctx}"), ("slots", f"{a.slots} x {a.slot_ctx}")):
        rows = {t: run_colibri(mode, coli, t, a) for t in a.types}
        for r in rows.values():
            if r["rc"] != 0:
                r.pop("peak_rss_mib", None)  # a failed run's peak is not the filled cache's
            elif r.get("peak_rss_mib") and base.get("peak_rss_mib"):
                r["rss_minus_base_mib"] = r["peak_rss_mib"] - base["peak_rss_mib"]
            if r.get("kv_bytes"):
                r["kv_mib"] = r["kv_bytes"] / 2**20
        print(f"  {label}")
        print(f"    {'K/V':<7}{'peak RSS MiB':>14}{'- baseline':>12}{'vs bf16':>9}{'kv_bytes MiB':>14}{'vs bf16':>9}"
              f"{'load':>6}")
        b = rows.get("bf16")
        for t, r in rows.items():
            print(f"    {t:<7}{_f(r, 'peak_rss_mib', '.0f'):>14}{_f(r, 'rss_minus_base_mib', '.0f'):>12}"
                  f"{_div(r, b, 'rss_minus_base_mib'):>9}{_f(r, 'kv_mib', '.1f'):>14}{_div(r, b, 'kv_mib'):>9}"
                  f"{r['load']:>6.1f}", flush=True)
        out[mode] = {t: _clean(r) for t, r in rows.items()}
    return out


def _clean(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("stdout", "stderr")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", choices=("speed", "memory"), default=["speed", "memory"])
    ap.add_argument("--types", nargs="+", choices=tuple(TYPES), default=list(TYPES), help="colibri K/V types")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=8192, help="context before the timed decode")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-ctx", type=int, default=32768, help="memory (a): one slot of this many positions")
    ap.add_argument("--slot-ctx", type=int, default=8192, help="memory (b): positions per slot")
    ap.add_argument("--slots", type=int, default=4, help="memory (b): slots")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/colibri-bench"))
    ap.add_argument("--json", type=Path, default=None, help="write all results here (default WORKDIR/bench_kv.json)")
    ap.add_argument("--worker", choices=("speed", "base", "long", "slots"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--kv", default="bf16", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    if a.long_ctx > MAX_POS or a.depth + a.tokens + 16 > MAX_POS:
        ap.error(f"contexts beyond the model's max_position_embeddings ({MAX_POS})")
    a.types = [t for t in TYPES if t in a.types]
    work = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "llamacpp"
    bin_dir = llamacpp.build(cache) if "speed" in a.part else None
    hf, coli, gguf = prepare(work, cache, "speed" in a.part)
    cfg = json.loads((hf / "config.json").read_text())
    print(f"OLMoE-shaped random model: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, {cfg['num_attention_heads']} heads of "
          f"{cfg['hidden_size'] // cfg['num_attention_heads']}, vocab {cfg['vocab_size']}, max positions "
          f"{cfg['max_position_embeddings']}; {a.threads} threads"
          + (f"; llama.cpp {llamacpp.version(bin_dir)}" if bin_dir else "") + f"  [load {os.getloadavg()[0]:.1f}]",
          flush=True)
    results: dict = {"threads": a.threads, "depth": a.depth, "tokens": a.tokens, "repeats": a.repeats,
                     "long_ctx": a.long_ctx, "slot_ctx": a.slot_ctx, "slots": a.slots}
    if "speed" in a.part:
        results["speed"] = part_speed(a, coli, gguf, bin_dir)
    if "memory" in a.part:
        results["memory"] = part_memory(a, coli)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    (a.json or work / "bench_kv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
