"""The Python API: `colibri.load(path) -> Engine`."""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import torch

from .container import Container
from .errors import ColibriError
from .generate import Stats, generate_tokens, make_sampler
from .models.base import bind, build
from .models.moe import SwitchGLU
from .store import Placement, TieredStore
from .store.tiered import PlacementFn, stats_delta
from .tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("colibri")


def physical_cores() -> int:
    """Physical cores (hyper-threads share the FPU, so more threads than this rarely helps)."""
    try:
        pairs = set()
        phys = core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                pairs.add((phys, core))
        return max(len(pairs), 1) if pairs else (os.cpu_count() or 1)
    except OSError:
        return os.cpu_count() or 1


def peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the parent."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compute_dtype_for(scheme: str) -> torch.dtype:
    """f32 containers compute in f32 (the oracle setting); everything else in bf16."""
    return torch.float32 if scheme == "f32" else torch.bfloat16


class Engine:
    """A loaded model: tokenizer, weights bound through the tiered store, and a KV cache for `ctx_size`.

    Memory tiers (docs/TIERS.md), all keyword-only:
    - `placement`: a `store.Placement` (per-layer "gpu" / "ram" / "disk", pinned hot experts),
      or a function `(ModelSizes, mem_budget, gpu_budget) -> Placement | None` that plans one.
      None: the planner (colibri/plan.py) places the layers from the budgets and the machine's
      free memory (`store.default_placement` is the store's simpler rule: all in RAM unless
      `mem_budget` is smaller than the model, then the last MoE layers' experts to disk).
    - `mem_budget`: bytes of RAM for weights (dense weights, RAM-layer experts and the expert
      cache of disk layers). Weights are then read into memory the engine owns instead of
      being mapped. None: no bound (weights are mapped; disk layers get a small default cache).
    - `gpu_budget`: bytes of VRAM for the GPU layers' weights; their experts go to a VRAM
      cache when they do not all fit. None: no bound.
    - `prefetch`: predict the next layer's experts with its router (look-ahead) and read them
      while the current layer computes.
    - `direct_io`: read experts with O_DIRECT (falls back to buffered reads where refused).
    - `gpu_device`: device of the "gpu" tier (default "cuda"; "cpu" runs the GPU code path on
      the CPU, for tests).
    Greedy output is bit-identical whatever the tiers, budgets, prefetch and I/O settings.
    """

    def __init__(self, path: str | os.PathLike, ctx_size: int = 4096, threads: int | None = None,
                 dtype: torch.dtype | None = None, verify: bool = False, *,
                 placement: Placement | PlacementFn | None = None, mem_budget: int | None = None,
                 gpu_budget: int | None = None, prefetch: bool = True, direct_io: bool = True,
                 gpu_device: str | None = None):
        if ctx_size <= 0:
            raise ColibriError(f"ctx_size must be positive, got {ctx_size}")
        torch.set_num_threads(threads or physical_cores())
        self.container = Container(path, verify=verify)
        c = self.container
        self.config = c.config
        self.tokenizer = Tokenizer(c.meta.get("tokenizer"), self.config)
        self.scheme = c.quant.get("scheme", "bf16")
        self.dtype = dtype or compute_dtype_for(self.scheme)
        self.model, self.args = build(c.model_type, self.config)
        if placement is None:  # planner (colibri/plan.py): no tier flags -> place by budgets and free memory
            from .plan import placement_fn

            placement = placement_fn(c, ctx_size)
        self.store = TieredStore(c, self.dtype, placement, mem_budget=mem_budget, gpu_budget=gpu_budget,
                                 prefetch=prefetch, direct_io=direct_io, gpu_device=gpu_device)
        try:
            bind(self.model, self.store)
            self.store.attach(self.model)
        except BaseException:
            self.store.close()
            raise
        self.model.model.embed_tokens.out_dtype = self.dtype
        self.model.eval()
        self.ctx_size = ctx_size
        self.caches = self.model.make_cache(ctx_size, self.dtype)
        for i, cache in enumerate(self.caches):
            if self.store.layer_device(i).type != "cpu":
                cache.to(self.store.layer_device(i))
        self.last_stats = Stats()

    @property
    def n_layers(self) -> int:
        return len(self.model.model.layers)

    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @torch.inference_mode()
    def logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (f32) for `token_ids`, from an empty cache."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ColibriError("logits() needs at least one token")
        if ids.numel() > self.ctx_size:
            raise ColibriError(f"{ids.numel()} tokens exceed ctx_size {self.ctx_size}")
        return self.model(ids, self.caches, 0)

    def generate_ids(self, prompt_ids: list[int], max_tokens: int = 256, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, repeat_penalty: float = 1.0, seed: int | None = None,
                     ignore_eos: bool = False) -> Iterator[int]:
        """Yield generated token ids; statistics land in `self.last_stats`."""
        if not prompt_ids:
            raise ColibriError("the prompt is empty (no tokens)")
        if len(prompt_ids) >= self.ctx_size:
            raise ColibriError(f"the prompt has {len(prompt_ids)} tokens, which does not fit ctx-size "
                               f"{self.ctx_size} (raise --ctx-size or shorten the prompt)")
        if not 0 < top_p <= 1 or top_k < 0 or temperature < 0 or repeat_penalty <= 0:
            raise ColibriError("bad sampling settings: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                               "repeat_penalty > 0")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        sampler = make_sampler(temperature, top_k, top_p, gen)
        self.last_stats = Stats()
        before = self.store.stats()
        yield from generate_tokens(self.model, self.caches, list(prompt_ids), max_tokens, sampler,
                                   ctx_size=self.ctx_size, eos_ids=self.tokenizer.eos_ids, ignore_eos=ignore_eos,
                                   repeat_penalty=repeat_penalty, stats=self.last_stats)
        self.last_stats.extra["peak_rss_mib"] = peak_rss_mib()
        self.last_stats.extra["store"] = stats_delta(before, self.store.stats())

    def store_stats(self) -> dict:
        """The weight store's cumulative counters (expert cache hits/misses, bytes read, prefetch
        precision/recall, resident bytes, ...); keys in docs/TIERS.md."""
        return self.store.stats()

    def generate(self, prompt: str, max_tokens: int = 256, *, add_special_tokens: bool = True, **kw) -> Iterator[str]:
        """Yield text pieces as they are generated (the prompt itself is not echoed).

        A prompt rendered by `tokenizer.apply_chat_template` already holds its special tokens:
        pass `add_special_tokens=False` for it (as transformers does)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        dec = StreamDecoder(self.tokenizer)
        for tok in self.generate_ids(ids, max_tokens, **kw):
            if tok in self.tokenizer.eos_ids and not kw.get("ignore_eos"):
                break
            if piece := dec.push(tok):
                yield piece
        if rest := dec.flush():
            yield rest

    def trace_routing(self, enabled: bool = True) -> None:
        """Log, per layer, the experts each generated token picked and their weights (debug level)."""
        def hook(layer: int, idx: torch.Tensor, weights: torch.Tensor) -> None:
            if idx.shape[0] == 1:
                pairs = ", ".join(f"{e}:{w:.3f}" for e, w in zip(idx[0].tolist(), weights[0].tolist()))
                log.debug("layer %2d experts %s", layer, pairs)

        for m in self.model.modules():
            if isinstance(m, SwitchGLU):
                m.on_route = hook if enabled else None

    def close(self) -> None:
        self.store.close()
        self.container.close()


def load(path: str | os.PathLike, ctx_size: int = 4096, threads: int | None = None, **kw) -> Engine:
    """Open a .coli container and return a ready `Engine`.

    `llm = colibri.load("m.coli", ctx_size=2048, threads=2)`;
    `for piece in llm.generate("Hello", max_tokens=32, temperature=0): print(piece, end="")`.
    """
    return Engine(path, ctx_size=ctx_size, threads=threads, **kw)
