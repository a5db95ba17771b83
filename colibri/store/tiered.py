"""TieredStore: puts each layer's weights on the GPU, in RAM or on disk, under byte budgets.

- GPU layers: dense weights and routed experts on `gpu_device` (experts in a VRAM cache
  when `gpu_budget` cannot hold them all); activations hop devices through forward pre-hooks.
- RAM layers: every weight resident.
- disk layers: dense weights resident; routed experts read from the file when the router
  picks them, into an `ExpertCache` of fixed slots sized by what `mem_budget` leaves over.

Every weight the model uses lives in memory this store allocated and filled with pread (never
pages of the container's mapping, which would count in RSS once touched without any bound we
control, and which the kernels read slower), so `stats()["resident_bytes"]` is what weights
really occupy. With `mmap=True` and no budget they stay zero-copy views of the mapping instead
(the fastest start).

Model files know nothing of this: the store hands `bind()` modules, tensors and one expert
source (store/experts.py: `fetch(layer, ids)`, `prefetch(layer, ids)`), and `attach()` binds
the look-ahead (store/lookahead.py) into the MoE layers and adds the GPU layers' device hops.
Which layers go where is the planner's decision (colibri/plan.py), handed in as a Placement.
See docs/TIERS.md and docs/DESIGN.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ..arena import aligned_buffer
from ..errors import ColibriError
from ..format.container import Container
from ..format.integrity import Checks
from ..format.layout import DTYPES
from ..layers.moe import ExpertWeights
from ..layers.mtp import PREFIX as MTP
from ..models.base import layer_of
from ..progress import Progress
from .cache import ExpertCache
from .experts import Experts
from .loader import RecordLoader, adopt, release_free_heap
from .lookahead import LookAhead
from .placement import Placement
from .reader import IO_THREADS, RecordReader, round_up
from .sizes import ModelSizes, human, model_sizes
from .weights import WeightStore, expert_weights

__all__ = ["PlacementFn", "TieredStore", "stats_delta"]

log = logging.getLogger("colibri")

# Cache size when disk layers are asked for without --mem-budget: this many experts per
# disk layer, in units of the router's top-k.
DEFAULT_CACHE_TOPK_PER_LAYER = 4
# Look-ahead predictions of a rank are read ahead only while at least this share of them is
# right (measured per run; see ExpertCache.rank_ok and docs/TIERS.md).
PREFETCH_MIN_PRECISION = 0.9
LOAD_BAR_BYTES = 1 << 30  # resident experts from this size on get a progress bar (on a terminal)
PlacementFn = Callable[["ModelSizes", "int | None", "int | None"], "Placement | None"]



# ----------------------------------------------------------------------------- the store


class TieredStore(WeightStore):
    """A WeightStore that places layers in tiers (see module doc). Use: `bind(model, store)`,
    then `store.attach(model)`; `stats()` any time; `close()` at the end."""

    def __init__(self, container: Container, compute_dtype: torch.dtype,
                 placement: Placement | PlacementFn | None = None, *, mem_budget: int | None = None,
                 gpu_budget: int | None = None, prefetch: bool = True, direct_io: bool = True,
                 gpu_device: str | torch.device | None = None, io_threads: int = IO_THREADS, policy: str = "reuse",
                 prefetch_min_precision: float = PREFETCH_MIN_PRECISION, mmap: bool = False,
                 keep: Callable[[str], bool] | None = None, routed: bool = True):
        super().__init__(container, compute_dtype)
        # `keep(name)`: the tensors this process uses (a cluster stage holds a range of layers, the head only the
        # ends: colibri/cluster); the others are never read, mapped or counted. None: all of them.
        # A container's MTP layers are never the main model's: engine/mtp.py loads them as a model of their own.
        own = keep or (lambda name: True)
        self.keep = lambda name: not name.startswith(MTP) and own(name)
        self.routed = routed  # False: the routed experts are served elsewhere (cluster expert workers): none read
        self.sizes = sizes = model_sizes(container, compute_dtype)
        if callable(placement):
            placement = placement(sizes, mem_budget, gpu_budget)
        if placement is None:  # the planner (colibri/plan.py) decides tiers; without one, all in RAM
            placement = Placement(["ram"] * sizes.n_layers, mem_budget=mem_budget)
        if len(placement.tiers) != sizes.n_layers:
            raise ColibriError(f"placement has {len(placement.tiers)} layers, the model {sizes.n_layers}")
        self.placement = placement
        self.mem_budget = mem_budget if mem_budget is not None else placement.mem_budget
        self.gpu_budget = gpu_budget if gpu_budget is not None else placement.gpu_budget
        self.prefetch_enabled, self.policy = prefetch, policy
        self.prefetch_min_precision = prefetch_min_precision
        self._gpu_layers = set(placement.layers("gpu"))
        self.gpu: torch.device | None = None
        if self._gpu_layers:
            self.gpu = torch.device(gpu_device or "cuda")
            if self.gpu.type == "cuda" and not torch.cuda.is_available():
                raise ColibriError("GPU layers were placed, but torch sees no CUDA device")
        # every record/tensor read from the file is checksummed before use (colibri/format/integrity.py)
        checks = Checks(container.path, container.header)
        self.reader = RecordReader(container.path, io_threads, direct_io, checks=checks)
        # Weights go to memory we allocate and fill: with a RAM budget for honest accounting, and by
        # default for speed -- the decode kernels read page-cache pages of the file ~1.3-1.6x slower
        # than the same bytes copied into anonymous memory (docs/TIERS.md, "Loading"). `mmap` keeps
        # them zero-copy views of the mapping (the fastest start), when there is no budget.
        self.read_mode = self.mem_budget is not None or not mmap
        if not self.read_mode:  # mapped weights: checked once before use
            try:
                checks.verify_mapped(self.reader.submit, self._mapped)
            except BaseException:
                self.reader.close()
                raise
        self.acct = {"ram_dense": 0, "ram_experts": 0, "gpu_dense": 0, "gpu_experts": 0}
        self._dense: dict[str, torch.Tensor] = {}
        # The expert source every MoE layer is bound to; which layer is resident or cached is
        # filled in by attach(), once the dense weights are loaded and the budgets left are known.
        self.source = Experts()
        self._prefixes: dict[int, str] = {}
        self.caches: dict[str, ExpertCache] = {}
        self._hooks: list = []
        self.tok = {"prefill_tokens": 0, "prefill_bytes_read": 0, "decode_tokens": 0, "decode_bytes_read": 0,
                    "decode_io_wait_s": 0.0, "decode_reader_bytes": 0, "decode_reader_busy_s": 0.0}
        if self.read_mode or self._gpu_layers:
            self._load_dense()
        if not self.read_mode:  # mapped dense weights: count what forward passes will touch
            self.acct["ram_dense"] += sum(e["nbytes"] for n, e in container.header["tensors"].items()
                                          if "record" not in e and self._device_of(n) is None and self.keep(n))
        self.load_bytes_read = self.reader.bytes_read
        self._mark_step()

    # ------------------------------------------------------------------ dense weights

    def _device_of(self, name: str) -> torch.device | None:
        i = layer_of(name)
        return self.gpu if i is not None and i in self._gpu_layers else None

    def _load_dense(self) -> None:
        """Read the dense tensors that need owned memory: all of them with a RAM budget (into one
        page-aligned arena, in parallel, O_DIRECT when allowed), and the GPU layers' ones."""
        entries = [(n, e) for n, e in self.c.header["tensors"].items() if "record" not in e and self.keep(n)]
        cpu = [(n, e) for n, e in entries if self.read_mode and self._device_of(n) is None]
        gpu = [(n, e) for n, e in entries if self._device_of(n) is not None]
        if cpu:
            total = sum(round_up(e["nbytes"]) for _, e in cpu)
            arena = aligned_buffer(total)
            jobs, pos = [], 0
            for n, e in sorted(cpu, key=lambda ne: ne[1]["offset"]):
                span = round_up(e["nbytes"])
                jobs.append((arena[pos : pos + span], e["offset"], e["nbytes"]))
                self._dense[n] = _typed(arena[pos : pos + e["nbytes"]], e)
                pos += span
            self.reader.read_ranges(jobs)
            self.acct["ram_dense"] += total
        if gpu:
            chunk = 16 << 20
            staging = aligned_buffer(chunk)
            for n, e in gpu:
                nb = e["nbytes"]
                dev = torch.empty(nb, dtype=torch.uint8, device=self.gpu)
                for pos in range(0, nb, chunk):
                    m = min(chunk, nb - pos)
                    self.reader.read_into(staging, e["offset"] + pos, m)
                    dev[pos : pos + m].copy_(staging[:m])
                self._dense[n] = _typed(dev, e)
                self.acct["gpu_dense"] += nb

    def _mapped(self, name: str, is_record: bool) -> bool:
        """Whether the engine uses this record/tensor through the file's mapping (`mmap`, no budget)."""
        i = layer_of(name)
        if not self.keep(name):
            return False
        if is_record:
            return i is None or i >= len(self.placement.tiers) or self.placement.tiers[i] == "ram"
        return self._device_of(name) is None

    def tensor(self, name: str) -> torch.Tensor:
        t = self._dense.get(name)
        return t if t is not None else super().tensor(name)

    def linear(self, prefix: str, bias: bool):
        q = super().linear(prefix, bias)  # tensors come through self.tensor
        extra = q.nbytes
        if bias and self.tensor(prefix + ".bias").dtype != self.compute_dtype:
            extra += q.bias.nbytes  # the bias cast to the compute dtype
        self.acct["gpu_dense" if self._device_of(prefix + ".weight") is not None else "ram_dense"] += extra
        return q

    def experts(self, prefix: str, module) -> Experts:
        if self.routed:
            self._prefixes[module.layer] = prefix
        return self.source

    # ------------------------------------------------------------------ after bind

    def attach(self, model: nn.Module) -> None:
        """Give every layer its expert source, move GPU layers, add the hooks. Call after bind()."""
        p, s = self.placement, self.sizes
        loader = RecordLoader(self.c, self.reader, self.compute_dtype, self._prefixes)
        self.loader = loader
        by_tier: dict[str, list[int]] = {"gpu": [], "ram": [], "disk": []}
        for layer in sorted(self._prefixes):
            by_tier[p.tiers[layer]].append(layer)

        # GPU layers: resident on the device if the budget allows, else a VRAM expert cache.
        gpu_cached: list[int] = []
        if by_tier["gpu"]:
            # (the gpu tier on a CPU device, for tests, builds CPU kernels with their extras)
            self._gpu_expert_bytes = s.gpu_expert_bytes if self.gpu.type != "cpu" else s.expert_bytes
            need = sum(s.n_experts[i] * self._gpu_expert_bytes[i] for i in by_tier["gpu"])
            left = None if self.gpu_budget is None else self.gpu_budget - self.acct["gpu_dense"]
            if left is not None and left < 0:
                raise ColibriError(f"--gpu-budget {human(self.gpu_budget)} is smaller than the GPU layers' "
                                   f"dense weights ({human(self.acct['gpu_dense'])})")
            if left is None or need <= left:
                self._make_resident(by_tier["gpu"], self.gpu, "gpu_experts")
            else:
                gpu_cached = by_tier["gpu"]
                slot = self._slot_span(gpu_cached, self._gpu_expert_bytes)
                if left < slot:
                    raise ColibriError(f"--gpu-budget {human(self.gpu_budget)} leaves no room for one expert "
                                       f"({human(slot)}) next to the GPU layers' dense weights "
                                       f"({human(self.acct['gpu_dense'])})")
                self._make_cache("gpu", gpu_cached, left // slot, self.gpu)

        # RAM layers resident; what the budget leaves goes to the disk layers' cache.
        if self.read_mode:
            self._make_resident(by_tier["ram"], torch.device("cpu"), "ram_experts")
        else:
            for layer in by_tier["ram"]:
                self.source.resident[layer] = self._mapped_experts(layer)
        if by_tier["disk"]:
            disk = by_tier["disk"]
            slot = self._slot_span(disk, s.expert_bytes)
            if self.mem_budget is None:
                n_slots = sum(min(s.n_experts[i], DEFAULT_CACHE_TOPK_PER_LAYER * s.top_k) for i in disk)
            else:
                left = self.mem_budget - self.acct["ram_dense"] - self.acct["ram_experts"]
                n_slots = left // slot
                if n_slots < 1:
                    raise ColibriError(
                        f"--mem-budget {human(self.mem_budget)} leaves no room for the expert cache: dense "
                        f"weights take {human(self.acct['ram_dense'])}, RAM-layer experts "
                        f"{human(self.acct['ram_experts'])}, and one expert needs {human(slot)} "
                        f"(raise the budget to at least "
                        f"{human(self.acct['ram_dense'] + self.acct['ram_experts'] + slot)} or move layers "
                        "to the disk tier)")
            self._make_cache("ram", disk, n_slots, torch.device("cpu"))

        if self.mem_budget is not None and self.resident_bytes() > self.mem_budget:
            fix = "put more layers on the disk tier" if s.moe_layers else "a model without experts keeps them all"
            raise ColibriError(f"--mem-budget {human(self.mem_budget)} is too small for this placement "
                               f"({p.describe()}): the resident weights alone take "
                               f"{human(self.resident_bytes())}; {fix}")

        release_free_heap()
        blocks = model.model.layers
        self._move_gpu_layers(model, blocks)
        if self.prefetch_enabled and self.caches:
            self.source.ahead = LookAhead(self.source, blocks)
        self._mark_step()  # (the loads and pins above are no step's reads)

    def _mapped_experts(self, layer: int) -> list[ExpertWeights]:
        """A RAM layer's experts as views of the mapping (no budget). The buffers the modules
        allocate (int4 repack, casts) move into one arena as each expert is built: left on the
        heap, interleaved with the repack's large temporaries, they fragment it (int4 RSS was
        ~1.8x the weights)."""
        s = self.sizes
        n, tail = s.n_experts[layer], s.expert_bytes[layer] - round_up(s.record_bytes[layer])
        arena = aligned_buffer(n * tail)
        infos = self.record_infos(f"{self._prefixes[layer]}.0")
        experts = []
        for e in range(n):
            r = self.c.record(f"{self._prefixes[layer]}.{e}")
            w = expert_weights({sub: self.c.tensor(full) for sub, full in r["tensors"].items()}, infos,
                               self.compute_dtype)
            if tail:
                adopt(w, arena[e * tail : (e + 1) * tail])
            experts.append(w)
        self.acct["ram_experts"] += n * (s.record_bytes[layer] + tail)
        release_free_heap()
        return experts

    def _make_resident(self, layers: list[int], device: torch.device, bucket: str) -> None:
        """Read whole layers' experts into one arena (each expert a slot: record, then the
        modules' own buffers), in parallel on the reader pool."""
        if not layers:
            return
        jobs = [(layer, e) for layer in layers for e in range(self.sizes.n_experts[layer])]
        per = self._gpu_expert_bytes if bucket == "gpu_experts" else self.sizes.expert_bytes
        span_of = {layer: self._slot_span([layer], per) for layer in layers}
        spans = [span_of[layer] for layer, _ in jobs]
        total = sum(spans)
        arena = (aligned_buffer(total) if device.type == "cpu"
                 else torch.empty(total, dtype=torch.uint8, device=device))
        futs, pos = [], 0
        for (layer, e), span in zip(jobs, spans):
            futs.append(self.reader.submit(self.loader.load, layer, e, arena[pos : pos + span]))
            pos += span
        experts: dict[int, list[ExpertWeights]] = {layer: [] for layer in layers}
        # (a bar on a terminal for the loads that take seconds: ~0.5-1 GB/s here, disk and module builds)
        with Progress(total, f"loading {len(jobs)} experts", enabled=None if total >= LOAD_BAR_BYTES else False) as bar:
            for (layer, _), f, span in zip(jobs, futs, spans):
                experts[layer].append(f.result())
                bar.update(span)
        self.source.resident.update(experts)
        self.acct[bucket] += total  # module buffers included: they were moved into the arena

    def _make_cache(self, name: str, layers: list[int], n_slots: int, device: torch.device) -> None:
        s = self.sizes
        cap = sum(s.n_experts[i] for i in layers)
        n_slots = max(1, min(n_slots, cap))
        span = self._slot_span(layers, self._gpu_expert_bytes if name == "gpu" else s.expert_bytes)
        cache = ExpertCache(self.loader, n_slots, span, layers, submit=self.reader.submit, device=device,
                            policy=self.policy, min_precision=self.prefetch_min_precision,
                            io_depth=self.reader.threads, ahead=self.reader)
        for layer in layers:
            pins = self.placement.pinned.get(layer, [])
            if pins:
                cache.pin(layer, [e for e in pins if 0 <= e < s.n_experts[layer]])
            self.source.cached[layer] = cache
        self.caches[name] = cache
        log.info("colibri: %s expert cache: %d slots of %s for layers %s%s", name, n_slots,
                 human(cache.slot_bytes), _ranges(layers),
                 " (O_DIRECT)" if self.reader.direct else "")

    def _slot_span(self, layers: list[int], per: list[int]) -> int:
        """Bytes of one cache slot for these layers: the loader's record span (where every slot's
        module buffers start), then the largest module tail (see slot_bytes)."""
        s = self.sizes
        return self.loader.rec_span + max(per[i] - round_up(s.record_bytes[i]) for i in layers)

    def _move_gpu_layers(self, model: nn.Module, blocks) -> None:
        if not self._gpu_layers:
            return
        cpu = torch.device("cpu")
        prev = cpu
        for i, block in enumerate(blocks):
            dev = self.gpu if i in self._gpu_layers else cpu
            if dev != cpu:
                block.to(dev)
            if dev != prev:
                self._hooks.append(block.register_forward_pre_hook(partial(_move_first_arg, dev)))
            prev = dev
        if prev != cpu:
            self._hooks.append(model.model.norm.register_forward_pre_hook(partial(_move_first_arg, cpu)))

    def layer_device(self, layer: int) -> torch.device:
        return self.gpu if layer in self._gpu_layers else torch.device("cpu")

    # ------------------------------------------------------------------ stats

    def bytes_read(self) -> int:
        """Expert bytes the caches have read from disk since load."""
        return sum(c.counts["bytes_read"] for c in self.caches.values())

    def io_wait_s(self) -> float:
        """Seconds the compute thread has waited for expert reads since load."""
        return sum(c.wait_s for c in self.caches.values())

    def count_step(self, prefill_rows: int, decode_rows: int, bytes_read: int) -> None:
        """One engine step's rows and the expert bytes it read (the runner calls this per step;
        a step with prompt rows counts its bytes as prefill)."""
        self.tok["prefill_tokens"] += prefill_rows
        self.tok["decode_tokens"] += decode_rows
        self.tok["prefill_bytes_read" if prefill_rows else "decode_bytes_read"] += bytes_read
        # What the reader and the compute thread did since the last step, by the same rule: the split of
        # a decode token's time into waiting on reads and the rest (docs/TIERS.md, "The streamed limit").
        wait, nbytes, busy = self._mark
        self._mark_step()
        if not prefill_rows:
            self.tok["decode_io_wait_s"] += self._mark[0] - wait
            self.tok["decode_reader_bytes"] += self._mark[1] - nbytes
            self.tok["decode_reader_busy_s"] += self._mark[2] - busy

    def _mark_step(self) -> None:
        self._mark = (self.io_wait_s(), self.reader.bytes_read, self.reader.busy_s())

    def resident_bytes(self) -> int:
        """RAM held by weights: dense + RAM-layer experts + the RAM expert cache (at capacity)."""
        cache = self.caches.get("ram")
        return self.acct["ram_dense"] + self.acct["ram_experts"] + (cache.capacity_bytes if cache else 0)

    def stats(self) -> dict:
        """Cumulative counters since load plus derived rates (keys documented in docs/TIERS.md)."""
        keys = ("hits", "misses", "evictions", "bytes_read", "reads", "prefetch_issued", "prefetch_used",
                "prefetch_wasted", "prefetch_wasted_bytes", "pred_hits", "pred_total", "actual_total")
        out: dict = {k: sum(c.counts[k] for c in self.caches.values()) for k in keys}
        out["io_wait_s"] = self.io_wait_s()
        out.update(self.tok)
        ram, gpu = self.caches.get("ram"), self.caches.get("gpu")
        out.update(
            placement=self.placement.describe(), tiers=list(self.placement.tiers),
            mem_budget=self.mem_budget, gpu_budget=self.gpu_budget,
            direct_io=self.reader.direct, prefetch=self.prefetch_enabled and bool(self.caches),
            policy=self.policy, read_mode=self.read_mode,
            dense_bytes=self.acct["ram_dense"], ram_expert_bytes=self.acct["ram_experts"],
            cache_bytes=ram.capacity_bytes if ram else 0, cache_slots=ram.n_slots if ram else 0,
            cache_used_slots=ram.used_slots if ram else 0, cache_pinned=ram.n_pinned if ram else 0,
            resident_bytes=self.resident_bytes(),
            gpu_dense_bytes=self.acct["gpu_dense"], gpu_expert_bytes=self.acct["gpu_experts"],
            gpu_cache_bytes=gpu.capacity_bytes if gpu else 0, gpu_cache_slots=gpu.n_slots if gpu else 0,
            load_bytes_read=self.load_bytes_read,
        )
        return derive(out)

    def close(self) -> None:
        for c in self.caches.values():
            c.drain()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.source.ahead = None
        self.reader.close()


COUNTERS = ("hits", "misses", "evictions", "bytes_read", "reads", "prefetch_issued", "prefetch_used",
            "prefetch_wasted", "prefetch_wasted_bytes", "pred_hits", "pred_total", "actual_total", "io_wait_s",
            "prefill_tokens", "prefill_bytes_read", "decode_tokens", "decode_bytes_read", "decode_io_wait_s",
            "decode_reader_bytes", "decode_reader_busy_s")


def derive(s: dict) -> dict:
    """Add the ratios (hit rate, bytes per token, prefetch precision/recall) to a counter dict."""
    lookups = s["hits"] + s["misses"]
    s["lookups"] = lookups
    s["hit_rate"] = s["hits"] / lookups if lookups else 0.0
    s["tokens"] = s["prefill_tokens"] + s["decode_tokens"]
    s["bytes_per_token"] = s["bytes_read"] / s["tokens"] if s["tokens"] else 0.0
    s["decode_bytes_per_token"] = s["decode_bytes_read"] / s["decode_tokens"] if s["decode_tokens"] else 0.0
    s["prefetch_precision"] = s["pred_hits"] / s["pred_total"] if s["pred_total"] else 0.0
    s["prefetch_recall"] = s["pred_hits"] / s["actual_total"] if s["actual_total"] else 0.0
    busy = s["decode_reader_busy_s"]
    s["decode_read_bps"] = s["decode_reader_bytes"] / busy if busy > 0 else 0.0
    return s


def stats_delta(before: dict, after: dict) -> dict:
    """`after` with its counters replaced by after - before (one run's share), ratios recomputed."""
    out = dict(after)
    for k in COUNTERS:
        out[k] = after[k] - before[k]
    return derive(out)


# ----------------------------------------------------------------------------- helpers


def _typed(raw: torch.Tensor, e: dict) -> torch.Tensor:
    """A uint8 span -> the tensor's dtype and shape (spans are 4096-aligned, so any dtype view is legal)."""
    dtype = DTYPES[e["dtype"]]
    if e["nbytes"] == 0:
        return torch.empty(e["shape"], dtype=dtype, device=raw.device)
    return raw.view(dtype).view(e["shape"])


def _move_first_arg(device: torch.device, module, args):
    return (args[0].to(device),) + tuple(args[1:])


def _ranges(layers: list[int]) -> str:
    if not layers:
        return "-"
    out, start, prev = [], layers[0], layers[0]
    for i in layers[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)
