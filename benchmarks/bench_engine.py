"""Engine core speed: colibri (bf16 / int8 / int4) next to transformers (bf16) on one mid-size MoE.

    .venv/bin/python benchmarks/bench_engine.py [--workdir /tmp/colibri-bench/engine] [--threads 2]
        [--tokens 64] [--prompt-len 128] [--profile int8]

Builds (once, cached in --workdir) a random OLMoE-shaped model with transformers: hidden 1024,
8 layers, 32 experts top-4, expert width 512, vocab 32000 (the tiny test tokenizer covers the
first 384 ids; prompts use those). Saves it in bf16, converts it to .coli at bf16, int8 and
int4, then times each engine in a fresh subprocess (so peak RSS is that engine's alone):
prefill of --prompt-len tokens, then --tokens greedy decode steps. Prints a table with ratios
to transformers (llama.cpp: benchmarks/bench_vs_llamacpp.py, which builds and runs it next to
colibri; no figure of another engine is typed in here). --profile SCHEME adds a torch.profiler
breakdown of colibri's decode steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CONFIG = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
          "num_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 512, "vocab_size": 32000,
          "max_position_embeddings": 4096, "norm_topk_prob": False, "tie_word_embeddings": False}
SCHEMES = ("bf16", "int8", "int4")


def build(workdir: Path) -> Path:
    """The HF folder (bf16 safetensors + tokenizer), built once."""
    hf = workdir / "olmoe-1024x8-hf"
    if (hf / "config.json").exists():
        return hf
    import torch
    from hf_tiny import BOS_ID, EOS_ID, PAD_ID, make_tokenizer_files
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    cfg = AutoConfig.for_model("olmoe", **CONFIG, **ids)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # transformers' own init (std 0.02)
    model.to(torch.bfloat16).save_pretrained(hf)
    make_tokenizer_files(hf)
    return hf


def convert_all(hf: Path, workdir: Path) -> dict[str, Path]:
    from colibri.convert.converter import convert

    out = {}
    for s in SCHEMES:
        out[s] = workdir / f"olmoe-1024x8.{s}.coli"
        if not out[s].exists():
            convert(hf, out[s], s, 64, progress=False)
    return out


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _prompt(n: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [1] + [rng.randrange(3, 384) for _ in range(n - 1)]  # ids the tiny tokenizer knows


def worker_colibri(a: argparse.Namespace) -> dict:
    import colibri

    llm = colibri.load(a.model, ctx_size=a.prompt_len + a.tokens + 8, threads=a.threads,
                       cache_prompt=False)  # the same prompt is timed in every round
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    prompt = _prompt(a.prompt_len)
    # Warm-up: oneDNN primitive creation and first page faults are not decode speed.
    list(llm.generate_ids(prompt[:8], 4, temperature=0, ignore_eos=True))
    best: dict = {}
    for _ in range(a.repeats):
        r = _timed(llm.generate_ids(prompt, a.tokens, temperature=0, ignore_eos=True), len(prompt))
        if not best or r["decode_tok_s"] > best["decode_tok_s"]:
            best = r
    if a.profile:
        best["profile"] = profile_decode(llm, prompt)
    best["peak_rss_mib"] = _peak_rss_mib()
    return best


def _timed(tokens, prompt_len: int) -> dict:
    """Wall and CPU time of prefill (up to the first token) and of the decode steps after it.

    CPU time (all threads of the process) is the figure that survives a busy machine: wall
    time also counts the time other programs held the cores. With --threads 1 it is what an
    idle machine would show as wall time.
    """
    w0, c0 = time.perf_counter(), time.process_time()
    first = next(tokens)
    w1, c1 = time.perf_counter(), time.process_time()
    toks = [first, *tokens]
    w2, c2 = time.perf_counter(), time.process_time()
    n = len(toks) - 1
    return {"prefill_tok_s": prompt_len / (w1 - w0), "decode_tok_s": n / (w2 - w1),
            "prefill_cpu_tok_s": prompt_len / (c1 - c0), "decode_cpu_tok_s": n / (c2 - c1), "tokens": toks}


def profile_decode(llm, prompt: list[int], steps: int = 16) -> str:
    """Where a decode step's time goes: torch ops (self CPU time) over `steps` tokens, the prompt's K/V
    taken from the slot's prompt cache (a first request fills it) so the profile is decode."""
    from torch.profiler import ProfilerActivity, profile

    list(llm.generate_ids(prompt, 1, temperature=0, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        list(llm.generate_ids(prompt, steps + 1, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - t0
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return f"{steps} decode steps, {wall / steps * 1e3:.1f} ms/token under the profiler\n{table}"


def worker_hf(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    prompt = _prompt(a.prompt_len)

    @torch.inference_mode()
    def greedy(ids: list[int], n: int):
        """A manual cached greedy loop (what generate() does, minus its logits processors)."""
        cache = DynamicCache(config=model.config)
        x = torch.tensor([ids])
        for _ in range(n):
            out = model(input_ids=x, past_key_values=cache, use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            yield tok
            x = torch.tensor([[tok]])

    list(greedy(prompt[:8], 4))
    best: dict = {}
    for _ in range(a.repeats):
        r = _timed(greedy(prompt, a.tokens), len(prompt))
        if not best or r["decode_tok_s"] > best["decode_tok_s"]:
            best = r
    best["peak_rss_mib"] = _peak_rss_mib()
    return best


def run_worker(kind: str, model: Path, a: argparse.Namespace, profile: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", str(model), "--threads", str(a.threads),
           "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--repeats", str(a.repeats)]
    if profile:
        cmd.append("--profile-worker")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"{kind} worker failed ({model}):\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["wall_s"] = time.perf_counter() - t0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/colibri-bench/engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per run")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per engine in its process; best is kept")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--profile", choices=SCHEMES, help="also profile colibri's decode at this scheme")
    ap.add_argument("--worker", choices=["colibri", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--profile-worker", dest="profile_worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.profile = a.profile_worker
        r = worker_colibri(a) if a.worker == "colibri" else worker_hf(a)
        print(json.dumps(r))
        return
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hf = build(work)
    colis = convert_all(hf, work)
    print(f"model: OLMoE-shaped {CONFIG['hidden_size']}x{CONFIG['num_hidden_layers']} layers, "
          f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_tok']}, expert width "
          f"{CONFIG['intermediate_size']}, vocab {CONFIG['vocab_size']} (built/converted in "
          f"{time.perf_counter() - t0:.0f}s); {a.threads} threads, prompt {a.prompt_len}, {a.tokens} tokens, "
          f"best of {a.repeats}", flush=True)
    rows = []
    if not a.no_hf:
        rows.append(("transformers bf16", run_worker("hf", hf, a)))
        print(f"  done: {rows[-1][0]}", file=sys.stderr, flush=True)
    for s in a.schemes:
        rows.append((f"colibri {s}", run_worker("colibri", colis[s], a, profile=a.profile == s)))
        print(f"  done: {rows[-1][0]}", file=sys.stderr, flush=True)
    base = rows[0][1] if not a.no_hf else None
    print(f"load average {os.getloadavg()[0]:.1f} (other work on the box inflates wall times; the CPU "
          "columns are tokens per CPU-second of the process, all threads)")
    print(f"{'engine':<18}{'decode tok/s':>13}{'(cpu)':>8}{'prefill tok/s':>15}{'(cpu)':>8}{'peak RSS':>10}"
          f"{'decode xHF':>12}{'(cpu)':>8}{'prefill xHF':>13}{'same tok':>10}")
    for name, r in rows:
        def x(key: str, r: dict = r) -> str:
            return f"{r[key] / base[key]:.2f}x" if base else "-"
        same = "-" if not base or r is base else f"{_agree(r['tokens'], base['tokens'])}/{len(r['tokens'])}"
        print(f"{name:<18}{r['decode_tok_s']:>13.2f}{r['decode_cpu_tok_s']:>8.2f}{r['prefill_tok_s']:>15.1f}"
              f"{r['prefill_cpu_tok_s']:>8.1f}{r['peak_rss_mib']:>7.0f} MiB{x('decode_tok_s'):>12}"
              f"{x('decode_cpu_tok_s'):>8}{x('prefill_tok_s'):>13}{same:>10}")
    print("llama.cpp on the same shape, measured in the same run: benchmarks/bench_vs_llamacpp.py --shape 0.44b")
    for name, r in rows:
        if "profile" in r:
            print(f"\nprofile ({name}):\n{r['profile']}")


def _agree(a: list[int], b: list[int]) -> int:
    """Leading tokens equal: greedy runs diverge for good after the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
