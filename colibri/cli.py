"""`colibri` command line: the seed's flags for running, plus subcommands.

    colibri [run] --model M.coli --prompt "Hello" -n 64 --ctx-size 1024 --threads 2
    colibri convert --input HF_FOLDER --output M.coli --arch moe --quant int8
    colibri inspect M.coli
    colibri plan --model M.coli --mem-budget 3G
    colibri bench --model M.coli --mem-budget 3G --json

stdout carries only generated text; banner, logs and stats go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

from .errors import ColibriError

SUBCOMMANDS = {
    "run": ("colibri.cli", "run_main"),
    "convert": ("colibri.convert", "main"),
    "inspect": ("colibri.inspect", "main"),
    "plan": ("colibri.plan", "main"),
    "bench": ("colibri.bench", "main"),
}
log = logging.getLogger("colibri")


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got '{text}'") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be positive, got {v}")
        return v
    return parse


def _nonneg(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got '{text}'") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v
    return parse


class _Help(argparse.HelpFormatter):
    """Shows a flag's default only when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in h:
            h += " (default: %(default)s)"
        return h


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colibri",
        description="Run a Mixture-of-Experts model from a .coli container (models larger than RAM welcome). "
                    "Subcommands: run (default), convert, inspect, plan, bench. 'colibri SUBCOMMAND --help' for each.",
        formatter_class=_Help)
    g = p.add_argument_group("model and prompt")
    g.add_argument("--model", "-m", help="path to a .coli container; omitted: the built-in demo model")
    g.add_argument("--prompt", "-p", help="the prompt text")
    g.add_argument("--file", "-f", help="read the prompt from this file instead of --prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    g.add_argument("-n", "--n-predict", type=_positive("-n"), default=128, help="number of tokens to generate")
    g.add_argument("--ctx-size", "-c", type=_positive("--ctx-size"), default=4096,
                   help="context length; the KV cache is preallocated for it (memory grows with it)")
    g.add_argument("--threads", "-t", type=_positive("--threads"), default=None,
                   help="torch CPU threads (default: number of physical cores)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy decoding")
    s.add_argument("--top-k", type=_nonneg("--top-k"), default=40, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (1.0 = off)")
    s.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise tokens already seen (1.0 = off)")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling (reproducible output)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence (benchmarks)")
    t = p.add_argument_group("memory tiers")
    t.add_argument("--gpu-layers", type=_nonneg("--gpu-layers"), default=None,
                   help="number of layers (from the first) kept in GPU memory")
    t.add_argument("--ram-layers", type=_nonneg("--ram-layers"), default=None,
                   help="number of layers (after the GPU ones) kept resident in RAM")
    t.add_argument("--disk-layers", type=_nonneg("--disk-layers"), default=None,
                   help="number of layers (the last) whose routed experts are read from disk on demand")
    t.add_argument("--mem-budget", default=None, metavar="SIZE",
                   help="RAM for weights, e.g. 12G: dense weights, RAM layers' experts and the expert "
                        "cache of disk layers; weights are then read into engine-owned memory (peak RSS "
                        "stays within SIZE + the runtime's fixed overhead). Without layer flags, layers' "
                        "experts move to disk as needed to fit")
    t.add_argument("--gpu-budget", default=None, metavar="SIZE",
                   help="VRAM for the GPU layers' weights; their experts are cached when they do not all fit")
    t.add_argument("--no-prefetch", action="store_true",
                   help="do not predict and read the next layer's experts ahead (router look-ahead)")
    t.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True,
                   help="read experts with O_DIRECT, bypassing the page cache (falls back when refused)")
    t.add_argument("--usage-file", default=None,
                   help="learned hot set (opt-in): add this run's expert routing counts to this JSON file, "
                        "and pin the experts hottest in past runs when planning the expert cache")
    o = p.add_argument_group("output")
    o.add_argument("--log-level", default="warning", choices=["error", "warning", "info", "debug"],
                   help="stderr verbosity; debug logs each token's experts and routing weights per layer")
    o.add_argument("--no-stats", action="store_true", help="do not print the stats line at the end")
    o.add_argument("--stats", action="store_true",
                   help="also print the memory-tier stats: expert cache hit rate, bytes read per token, "
                        "prefetch precision, resident bytes")
    o.add_argument("--verify", action="store_true", help="verify every checksum of the container before running")
    return p


def _setup_logging(level: str) -> None:
    """colibri's own stderr handler (replaced on every call, so repeated in-process runs behave)."""
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def _read_prompt(a: argparse.Namespace) -> str:
    if a.file:
        try:
            return Path(a.file).read_text()
        except OSError as e:
            raise ColibriError(f"cannot read prompt file {a.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ColibriError(f"prompt file {a.file} is not UTF-8 text") from None
    if a.prompt is None:
        raise ColibriError("no prompt: give --prompt TEXT or --file PATH")
    return a.prompt


def _validate_sampling(a: argparse.Namespace) -> None:
    if a.temperature < 0:
        raise ColibriError(f"--temperature must be >= 0, got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise ColibriError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.repeat_penalty <= 0:
        raise ColibriError(f"--repeat-penalty must be > 0, got {a.repeat_penalty}")


def run_main(argv: list[str] | None = None) -> int:
    a = run_parser().parse_args(argv)
    _setup_logging(a.log_level)
    _validate_sampling(a)
    prompt = _read_prompt(a)
    if a.model is None:
        from .demo import demo_model

        a.model = str(demo_model())
        log.warning("no --model given: using the built-in demo model %s", a.model)
    if a.prompt is not None and a.file:
        raise ColibriError("give either --prompt or --file, not both")
    if not Path(a.model).exists():
        raise ColibriError(f"model file {a.model} not found")

    import torch

    from .api import Engine
    from .store.placement import from_flags, parse_size

    mem_budget = parse_size(a.mem_budget) if a.mem_budget is not None else None
    gpu_budget = parse_size(a.gpu_budget) if a.gpu_budget is not None else None
    placement = None
    if a.gpu_layers is not None or a.ram_layers is not None or a.disk_layers is not None:
        # A planning function: the engine calls it once the layer count is known.
        placement = lambda sizes, *_: from_flags(sizes.n_layers, a.gpu_layers, a.ram_layers,  # noqa: E731
                                                 a.disk_layers, torch.cuda.is_available())
    if a.usage_file and a.gpu_layers is None and a.ram_layers is None and a.disk_layers is None:
        from .usage import hot_set_placement  # learned hot set: plan with past runs' routing counts

        placement = hot_set_placement(a.model, a.usage_file, a.ctx_size)
    t0 = time.perf_counter()
    llm = Engine(a.model, ctx_size=a.ctx_size, threads=a.threads, verify=a.verify, placement=placement,
                 mem_budget=mem_budget, gpu_budget=gpu_budget, prefetch=not a.no_prefetch,
                 direct_io=a.direct_io)
    log.info("loaded %s (%s, %s, %d layers) in %.2fs; KV cache %.1f MiB for ctx %d", a.model,
             llm.container.model_type, llm.scheme, llm.n_layers, time.perf_counter() - t0,
             llm.kv_bytes() / 2**20, a.ctx_size)
    if a.log_level == "debug":
        llm.trace_routing()
    recorder = None
    if a.usage_file:  # learned hot set: count this run's routing (colibri/usage.py)
        from .usage import Recorder

        recorder = Recorder(llm.model)
    if a.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=not a.chat)  # a chat template writes its own
    if len(ids) + a.n_predict > a.ctx_size:
        log.warning("colibri: prompt (%d tokens) + -n %d exceeds --ctx-size %d: generation stops when the "
                    "context is full", len(ids), a.n_predict, a.ctx_size)
    pieces = llm.generate(prompt, a.n_predict, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          repeat_penalty=a.repeat_penalty, seed=a.seed, ignore_eos=a.ignore_eos,
                          add_special_tokens=not a.chat)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if recorder is not None:
        total = recorder.usage().save(a.usage_file)
        log.info("usage file %s: %d routed tokens recorded in total", a.usage_file, total.total_tokens())
    st = llm.last_stats
    if st.stop_reason == "ctx":
        print(f"colibri: stopped: the context is full (--ctx-size {a.ctx_size}); raise --ctx-size to go on",
              file=sys.stderr)
    if not a.no_stats:
        print(stats_line(st), file=sys.stderr)
    if a.stats:
        print(tier_stats_line(st), file=sys.stderr)
    return 0


def stats_line(st) -> str:
    rss = st.extra.get("peak_rss_mib", 0.0)
    return (f"[colibri] prompt {st.prompt_tokens} tok, prefill {st.prefill_tps:.1f} tok/s | "
            f"generated {st.generated} tok, decode {st.decode_tps:.2f} tok/s | "
            f"TTFT {st.ttft_s * 1000:.0f} ms | peak RSS {rss:.0f} MiB")


def tier_stats_line(st) -> str:
    """The --stats line: speeds, then what the memory tiers did during this run."""
    s = st.extra.get("store", {})
    mib = 2**20
    line = (f"[colibri] tiers: {s.get('placement', '?')} | prefill {st.prefill_tps:.1f} tok/s, decode "
            f"{st.decode_tps:.2f} tok/s, TTFT {st.ttft_s * 1000:.0f} ms | peak RSS "
            f"{st.extra.get('peak_rss_mib', 0.0):.0f} MiB, weights resident "
            f"{s.get('resident_bytes', 0) / mib:.0f} MiB")
    if s.get("cache_slots"):
        line += (f" | expert cache {s['cache_slots']} slots ({s['cache_bytes'] / mib:.0f} MiB): hit rate "
                 f"{s['hit_rate']:.1%}, read {s['bytes_read'] / mib:.1f} MiB = "
                 f"{s['bytes_per_token'] / mib:.2f} MiB/token "
                 f"(decode {s['decode_bytes_per_token'] / mib:.2f}), "
                 f"I/O wait {s['io_wait_s']:.2f} s, {'O_DIRECT' if s['direct_io'] else 'buffered'}")
        if s.get("prefetch"):
            line += (f" | prefetch precision {s['prefetch_precision']:.1%}, "
                     f"recall {s['prefetch_recall']:.1%}, used {s['prefetch_used']}/{s['prefetch_issued']}")
    return line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        mod, fn = SUBCOMMANDS[argv[0]]
        entry, rest = getattr(importlib.import_module(mod), fn), argv[1:]
    else:
        entry, rest = run_main, argv
    try:
        return entry(rest) or 0
    except ColibriError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except MemoryError:
        print("colibri: error: out of memory (try a smaller --ctx-size, a lower-bit --quant, or fewer "
              "--ram-layers)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
