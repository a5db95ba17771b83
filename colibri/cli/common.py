"""The engine flags shared by `run`, `serve`, `chat` and `bench`, and the Engine they build.

One `add_engine_args(parser)` adds them; one `engine_from_args(args)` turns them into a loaded
`colibri.api.Engine`, so the commands cannot drift apart.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

from ..errors import ColibriError
from .clusterflags import add_cluster_args, check_cluster_args
from .kvflags import add_cache_type_args

log = logging.getLogger("colibri")


def positive(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got '{text}'") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be positive, got {v}")
        return v
    return parse


def nonneg(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got '{text}'") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v
    return parse


# More positions than this is a typo, not a context (and would fail in the allocator, not here).
MAX_CTX = 1 << 24


def bounded(name: str, lo: int, hi: int):
    """An integer flag in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got '{text}'") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def number(name: str, lo: float, hi: float = math.inf, lo_open: bool = False):
    """A finite float flag in [lo, hi] (`lo_open`: lo itself excluded): nan, inf and 1e400 are refused."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got '{text}'") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else \
                f"{'> ' if lo_open else '>= '}{lo:g}"
            raise argparse.ArgumentTypeError(f"{name} must be a finite number {rng}, got '{text}'")
        return v
    return parse


def size(name: str):
    """A byte size flag ('12G', '1500M'): checked now, kept as text (engine_from_args parses it)."""
    def parse(text: str) -> str:
        from ..store.placement import parse_size

        try:
            v = parse_size(text)
        except ColibriError as e:
            raise argparse.ArgumentTypeError(f"{name}: {e}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be above 0, got '{text}'")
        return text
    return parse


class HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default only when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in h:
            h += " (default: %(default)s)"
        return h


def add_engine_args(p: argparse.ArgumentParser, *, model_required: bool = False, ctx_size: int = 4096,
                    slots: int = 1) -> None:
    """The flags that load a model: model, context, threads, memory tiers, batching, logging."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", required=model_required,
                   help="path to a .coli container" + ("" if model_required else "; omitted: the built-in demo model"))
    g.add_argument("--ctx-size", "-c", type=bounded("--ctx-size", 1, MAX_CTX), default=ctx_size,
                   help="context length per slot; the KV cache is preallocated for it (memory grows with it)")
    g.add_argument("--threads", "-t", type=positive("--threads"), default=None,
                   help="torch CPU threads (default: number of physical cores)")
    g.add_argument("--slots", type=positive("--slots"), default=slots,
                   help="requests decoded together (one KV cache of --ctx-size each)")
    g.add_argument("--max-queue", type=nonneg("--max-queue"), default=64,
                   help="requests waiting for a slot beyond which new ones are refused")
    g.add_argument("--prefill-chunk", type=positive("--prefill-chunk"), default=512,
                   help="prompt tokens prefilled per engine step (long prompts do not stall running requests)")
    g.add_argument("--decode-run-ms", type=number("--decode-run-ms", 0, 10_000), default=None, metavar="MS",
                   help="requests without penalties or log-probs decode up to this long per native call, their tokens "
                        "streamed a run at a time (default 50; 0: every token as it is made)")
    g.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the K/V a free slot holds for the start of a new prompt (a chat's earlier turns); "
                        "off while routes are traced or logged")
    add_cache_type_args(g)
    add_cluster_args(p, positive, number)
    g.add_argument("--verify", action="store_true", help="verify every checksum of the container before running")
    g.add_argument("--log-level", default="warning", choices=["error", "warning", "info", "debug"],
                   help="stderr verbosity; debug logs each token's experts and routing weights per layer")
    g.add_argument("--route-trace", metavar="FILE", default=None,
                   help="append every token's experts and routing weights to FILE (JSON lines, docs/ROUTING.md; "
                        "analyse with 'colibri routes FILE')")
    t = p.add_argument_group("memory tiers")
    t.add_argument("--gpu-layers", "-ngl", "--n-gpu-layers", type=nonneg("--gpu-layers"), default=None,
                   help="number of layers (from the first) kept in GPU memory (-ngl: the llama.cpp spelling)")
    t.add_argument("--ram-layers", type=nonneg("--ram-layers"), default=None,
                   help="number of layers (after the GPU ones) kept resident in RAM")
    t.add_argument("--disk-layers", type=nonneg("--disk-layers"), default=None,
                   help="number of layers (the last) whose routed experts are read from disk on demand")
    t.add_argument("--mem-budget", type=size("--mem-budget"), default=None, metavar="SIZE",
                   help="RAM for weights, e.g. 12G: dense weights, RAM layers' experts and the expert "
                        "cache of disk layers; weights are then read into engine-owned memory (peak RSS "
                        "stays within SIZE + the runtime's fixed overhead). Without layer flags, layers' "
                        "experts move to disk as needed to fit")
    t.add_argument("--gpu-budget", type=size("--gpu-budget"), default=None, metavar="SIZE",
                   help="VRAM for the GPU layers' weights; their experts are cached when they do not all fit")
    t.add_argument("--no-prefetch", action="store_true",
                   help="do not predict and read the next layer's experts ahead (router look-ahead)")
    t.add_argument("--cache-policy", choices=("reuse", "fair", "lru"), default="reuse",
                   help="expert cache eviction (docs/ROUTING.md, the cache-policy lab): reuse = expected "
                        "reuse distance (default), fair = per-layer LRU shares, lru = global LRU")
    t.add_argument("--mmap", action="store_true",
                   help="without --mem-budget, use the weights through the file's mapping (zero-copy: the fastest "
                        "start) instead of reading them into engine-owned memory, which decode reads faster")
    t.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True,
                   help="read experts with O_DIRECT, bypassing the page cache (falls back when refused)")
    t.add_argument("--usage-file", default=None,
                   help="learned hot set (opt-in): add this run's expert routing counts to this JSON file, "
                        "and pin the experts hottest in past runs when planning the expert cache")


def setup_logging(level: str) -> None:
    """colibri's own stderr handler (replaced on every call, so repeated in-process runs behave)."""
    for h in list(log.handlers):
        log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def resolve_model(a: argparse.Namespace) -> str:
    """`--model`, or the built-in demo model when it is omitted; refuses a missing file."""
    if a.model is None:
        from ..demo import demo_model

        # (--spec mtp: with its MTP layer, at int8: a verify is exact on the native step, not on torch at bf16)
        a.model = str(demo_model("int8", mtp=True) if getattr(a, "spec", None) == "mtp" else demo_model())
        log.warning("no --model given: using the built-in demo model %s", a.model)
    path = Path(a.model)
    if path.is_dir():
        if (path / "config.json").exists():
            raise ColibriError(f"{a.model} is a Hugging Face folder: convert it first: "
                               f"colibri convert -i {a.model} -o OUT.coli")
        raise ColibriError(f"{a.model} is a folder: --model takes a .coli file")
    if not path.exists():
        raise ColibriError(f"model file {a.model} not found")
    return a.model


def check_writable(flag: str, path: str) -> None:
    """Refuse now a file the run would only fail to write at its end (after generating)."""
    p = Path(path)
    if p.is_dir():
        raise ColibriError(f"{flag} {path} is a folder, not a file")
    where = p if p.exists() else (p.parent if str(p.parent) else Path("."))
    if not where.exists():
        raise ColibriError(f"{flag} {path}: folder {where} does not exist")
    if not os.access(where, os.W_OK):
        raise ColibriError(f"{flag} {path}: {'the file' if p.exists() else f'folder {where}'} is not writable")


def _mem_available() -> int | None:
    from ..analysis.probe import mem_available

    return mem_available()[0] or None


def check_kv_fits(model: str, ctx: int, slots: int, kv_types=None) -> None:
    """A context whose KV cache (preallocated, zero-filled: slots x ctx x bytes per position) cannot fit in
    memory is refused now, in one line, rather than swapping for minutes or failing in the allocator.
    Only long contexts pay for the check (one more header read and a model skeleton)."""
    if ctx * slots <= 1 << 16:
        return
    import torch

    from ..format.container import Container
    from ..format.validate import build_checked
    from ..layers.kvquant import KVTypes

    with Container(model) as c:
        skeleton, _ = build_checked(c.model_type, c.config)
        dtype = torch.float32 if c.quant.get("scheme") == "f32" else torch.bfloat16
    per_pos, fixed = skeleton.cache_cost(dtype, KVTypes.of(kv_types))
    need, avail = (per_pos * ctx + fixed) * slots, _mem_available()
    if avail is not None and need > avail - (1 << 30):  # 1 GiB left to the weights, runtime and system
        raise ColibriError(f"--ctx-size {ctx} x --slots {slots} needs a {need / 2**30:.1f} GiB KV cache and "
                           f"{avail / 2**30:.1f} GiB of memory is available: lower --ctx-size (or quantize the "
                           "cache: -ctk q8_0 -ctv q8_0)")


def check_engine_args(a: argparse.Namespace) -> None:
    """The engine flags' checks that argparse types cannot make (files, the machine); one line each."""
    if a.usage_file:
        check_writable("--usage-file", a.usage_file)
    if a.route_trace:
        check_writable("--route-trace", a.route_trace)
    if a.threads is not None and a.threads > (os.cpu_count() or 1):
        log.warning("colibri: --threads %d is more than the %d CPUs of this machine: expect it to run much "
                    "slower (try --threads %d)", a.threads, os.cpu_count() or 1, os.cpu_count() or 1)
    if a.gpu_budget is not None:  # (--gpu-layers N without a GPU is refused by the placement)
        import torch

        if not torch.cuda.is_available():
            log.warning("colibri: --gpu-budget ignored: no CUDA GPU is available, everything runs on the CPU")


def engine_from_args(a: argparse.Namespace):
    """Load the `colibri.api.Engine` the engine flags describe."""
    import torch

    from ..api import Engine
    from ..store.placement import from_flags, parse_size

    model = resolve_model(a)
    check_engine_args(a)
    if getattr(a, "spec", None) == "draft" and not getattr(a, "draft_model", None):  # (before the wait of loading)
        raise ColibriError("--spec draft needs a draft model: add --draft-model PATH")
    if getattr(a, "draft_model", None) == "demo":  # the built-in demo's own draft (colibri/data/demo-draft)
        from ..demo import demo_model

        a.draft_model = str(demo_model("int8", draft=True))
    elif getattr(a, "draft_model", None) and not Path(a.draft_model).is_file():
        raise ColibriError(f"draft model file {a.draft_model} not found")
    check_cluster_args(a, ColibriError)
    kv_types = (a.cache_type_k, a.cache_type_v)
    if a.cluster is None:  # (on a cluster the K/V live on the stages)
        check_kv_fits(model, a.ctx_size, a.slots, kv_types)
    mem_budget = parse_size(a.mem_budget) if a.mem_budget is not None else None
    gpu_budget = parse_size(a.gpu_budget) if a.gpu_budget is not None else None
    layer_flags = a.gpu_layers is not None or a.ram_layers is not None or a.disk_layers is not None
    placement = None
    if layer_flags:
        # A planning function: the engine calls it once the layer count is known.
        placement = lambda sizes, *_: from_flags(sizes.n_layers, a.gpu_layers, a.ram_layers,  # noqa: E731
                                                 a.disk_layers, torch.cuda.is_available())
    elif a.usage_file:
        from ..plan import hot_set_placement  # learned hot set: plan with past runs' routing counts

        placement = hot_set_placement(model, a.usage_file, a.ctx_size, kv_types=kv_types)
    try:
        llm = Engine(model, ctx_size=a.ctx_size, threads=a.threads, verify=a.verify, placement=placement,
                     mem_budget=mem_budget, gpu_budget=gpu_budget, prefetch=not a.no_prefetch,
                     direct_io=a.direct_io, slots=a.slots, max_queue=a.max_queue, prefill_chunk=a.prefill_chunk,
                     route_trace=a.route_trace, cache_policy=a.cache_policy,
                     cache_prompt=a.cache_prompt, decode_run_ms=a.decode_run_ms, mmap=a.mmap, kv_type=kv_types,
                     cluster=a.cluster, cluster_mode=a.cluster_mode, cluster_stages=a.cluster_stages,
                     cluster_timeout=a.cluster_timeout, draft_model=getattr(a, "draft_model", None),
                     mtp=getattr(a, "spec", None) == "mtp")
    except (MemoryError, RuntimeError) as e:
        # The KV cache (slots x ctx x per-position bytes) is allocated up front: a huge --ctx-size fails here.
        if isinstance(e, RuntimeError) and "alloc" not in str(e) and "memory" not in str(e):
            raise
        raise ColibriError(f"out of memory loading the model with --ctx-size {a.ctx_size} x --slots {a.slots}: "
                           "lower --ctx-size (or --slots, or use a lower-bit --quant)") from None
    if a.log_level == "debug":
        llm.trace_routing()  # one stderr line per (token, MoE layer): colibri/analysis/routelog.py
    return llm
