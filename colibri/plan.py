"""The placement planner: `colibri plan` and `auto_placement()` (what the Engine uses by default).

It reads only the container header (sizes, never weight data) and the machine (MemAvailable,
free VRAM, a ~0.5 s O_DIRECT read-speed probe of the container itself), then decides per layer:
GPU or RAM-resident, or disk with an expert cache of N slots. All dense weights (attention,
routers, norms, embeddings, lm_head) stay resident: they are a few percent of an MoE model and
every token needs all of them, whereas a token touches only top_k of E experts per layer.

Byte accounting is the TieredStore's own (`store.tiered.model_sizes`), so a plan's budget is
exactly what `colibri run --mem-budget` would hold. The cost model per token:
    disk bytes = sum over disk layers of top_k * (1 - hit) * expert record bytes
    RAM bytes  = all resident dense bytes + top_k * expert record bytes per non-GPU MoE layer
    tok/s bound = 1 / (disk bytes / disk speed + RAM bytes / RAM bandwidth)
hit = slots / E under uniform routing, or from recorded routing counts (--usage-file).
The seed's hand formula (whole layers vs free memory, fixed headroom, no cache) is the baseline.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import sys
import time
from dataclasses import dataclass, field, fields

from .errors import ColibriError
from .store.placement import Placement, parse_size
from .store.tiered import ModelSizes, model_sizes

GiB, MiB = 1 << 30, 1 << 20
RAM_BPS = 18e9  # CPU memory bandwidth a decode step sustains on this class of machine (STREAM-like)
RUNTIME_BYTES = 512 * MiB  # python + torch + tokenizer RSS before any weight (measured ~400 MiB)
OUR_RAM_HEADROOM = 1 * GiB  # left to the OS and other programs when planning from MemAvailable
SEED_RAM_HEADROOM, SEED_VRAM_HEADROOM = 4 * GiB, 1 * GiB  # the seed's hand formula
VRAM_HEADROOM = 1 * GiB  # CUDA context + activations
PIN_SHARE = 0.75  # at most this share of the cache's slots is pinned; the rest stays LRU (recency)
DEFAULT_CTX = 4096


@dataclass
class PlanSizes(ModelSizes):
    """The store's ModelSizes (memory costs, same accounting as the TieredStore that will run the
    plan) plus what only the cost model needs: the embedding's size and row, the KV cache."""

    embed_bytes: int = 0  # in global_dense_bytes; a token reads one row of it, not all
    embed_row: int = 0
    kv_per_token: int = 0  # KV cache bytes per context position (all layers)
    scheme: str = "?"
    model_type: str = "?"

    @classmethod
    def from_container(cls, c, kv_per_token: int | None = None) -> PlanSizes:
        """From a Container, or anything with its `header`, `config` and `quant` (tests use stubs)."""
        base = model_sizes(c)
        embed = next((e for n, e in c.header["tensors"].items() if n.endswith("embed_tokens.weight")), None)
        kv = kv_per_token
        if kv is None:
            kv = _kv_measured(c) or _kv_formula(c.config, base.n_layers)
        return cls(**{f.name: getattr(base, f.name) for f in fields(ModelSizes)},
                   embed_bytes=embed["nbytes"] if embed else 0,
                   embed_row=embed["nbytes"] // max(embed["shape"][0], 1) if embed else 0,
                   kv_per_token=kv, scheme=c.quant.get("scheme", "?"),
                   model_type=(c.header.get("meta") or {}).get("model_type", "?"))

    def layer_bytes(self, i: int) -> int:
        return self.layer_dense_bytes[i] + self.layer_experts_bytes(i)

    def active_bytes(self, i: int) -> int:
        """Bytes a decode token touches in layer i: its dense part and top_k experts."""
        return self.layer_dense_bytes[i] + min(self.top_k, self.n_experts[i]) * self.record_bytes[i]

    @property
    def global_active(self) -> int:
        return self.global_dense_bytes - self.embed_bytes + self.embed_row


def _kv_formula(cfg: dict, n_layers: int) -> int:
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 0) // heads)
    return 2 * n_layers * kv * hd * 2  # K and V, bf16


def _kv_measured(c) -> int | None:
    """KV bytes per position from the family's own cache (MLA, sliding windows...); None if unknown."""
    try:
        import torch

        from .models.base import build

        model, _ = build(c.model_type, c.config)
        caches = model.make_cache(64, torch.bfloat16)
        return sum(x.nbytes for x in caches) // 64
    except Exception:  # an unknown family (or a test stub) still gets a plan, from the formula
        return None


@dataclass
class Machine:
    mem_available: int
    mem_free: int
    vram_free: int | None  # None: no CUDA device
    disk_bps: float
    ram_bps: float = RAM_BPS
    disk_note: str = "given"


def meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def measure_disk(path: str, seconds: float = 0.5, chunk: int = 4 * MiB,
                 threads: int = 4) -> tuple[float, str]:
    """Read speed of `path`'s device: random aligned O_DIRECT reads of expert-record size, issued
    by `threads` readers at once as the store's I/O pool does (SSDs need queue depth to reach speed).

    O_DIRECT bypasses the page cache, so this is the device, not RAM, whatever was read before.
    Falls back to buffered reads where O_DIRECT is refused (tmpfs), and says so.
    """
    import random
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path)
    chunk = max(4096, min(chunk, size) // 4096 * 4096)
    note = "O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd, note = os.open(path, os.O_RDONLY), "buffered (O_DIRECT refused; may be page-cache speed)"
    slots = max(size // chunk - 1, 1)
    deadline = time.perf_counter() + seconds

    def reader(seed: int) -> int:
        buf, rng, done = mmap.mmap(-1, chunk), random.Random(seed), 0  # page-aligned, as O_DIRECT requires
        try:
            while time.perf_counter() < deadline:
                done += os.preadv(fd, [buf], rng.randrange(slots) * chunk)
        finally:
            buf.close()
        return done

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(reader, range(threads)))
    except OSError:  # O_DIRECT refused at the first read (some filesystems): measure buffered
        os.close(fd)
        fd, note = os.open(path, os.O_RDONLY), "buffered (O_DIRECT failed; may be page-cache speed)"
        deadline, t0 = time.perf_counter() + seconds, time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(reader, range(threads)))
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    return (done / dt if dt > 0 else 0.0), (f"{note}, {seconds:.1f} s of {chunk / MiB:.1f} MiB random reads, "
                                            f"{threads} at a time")


def current_machine() -> Machine:
    """Memory and VRAM now; disk speed is not probed (it changes the predicted speed, not the plan)."""
    mi = meminfo()
    vram = None
    try:
        import torch

        if torch.cuda.is_available():
            vram = torch.cuda.mem_get_info()[0]
    except Exception:  # a broken CUDA install plans as CPU-only
        vram = None
    return Machine(mi.get("MemAvailable", 0), mi.get("MemFree", 0), vram, 1e9, RAM_BPS, "not measured")


def probe_machine(path: str, seconds: float = 0.5, chunk: int = 4 * MiB) -> Machine:
    """Memory and VRAM now, plus the read speed of `path`'s device."""
    m = current_machine()
    if seconds > 0:
        m.disk_bps, m.disk_note = measure_disk(path, seconds, chunk)
    return m


@dataclass
class LayerPlan:
    tier: str  # gpu | ram | disk
    slots: int = 0  # expert cache slots (disk layers); all experts for resident ones
    pinned: list[int] = field(default_factory=list)
    hit: float = 1.0  # expected share of this layer's routed experts found in memory


@dataclass
class PlanResult:
    name: str
    layers: list[LayerPlan]
    weights_budget: int  # RAM for weights: dense + RAM-layer experts + expert cache (the store's mem_budget)
    gpu_budget: int
    resident: int  # weights in RAM outside the expert cache (dense + whole RAM layers)
    gpu_bytes: int
    cache_bytes: int  # expert cache in RAM (disk layers)
    disk_per_token: float
    ram_per_token: float
    disk_bps: float
    ram_bps: float
    notes: list[str] = field(default_factory=list)
    budgeted: bool = True  # False: everything fits unbounded, keep the zero-copy mapping

    @property
    def tok_s(self) -> float:
        t = self.disk_per_token / max(self.disk_bps, 1.0) + self.ram_per_token / self.ram_bps
        return 1.0 / t if t > 0 else math.inf

    def count(self, tier: str) -> int:
        return sum(lp.tier == tier for lp in self.layers)

    def placement(self) -> Placement:
        """The store's Placement: tiers, the RAM/GPU weight budgets, pinned hot experts."""
        return Placement([lp.tier for lp in self.layers],
                         mem_budget=self.weights_budget if self.budgeted else None,
                         gpu_budget=self.gpu_budget if self.count("gpu") else None,
                         pinned={i: lp.pinned for i, lp in enumerate(self.layers) if lp.pinned})


def weights_budget(m: Machine, sizes: PlanSizes, mem_budget: int | None, ctx: int) -> int:
    """RAM for weights: --mem-budget as given (as `colibri run` reads it), or what MemAvailable
    leaves after our headroom, the KV cache and the runtime."""
    if mem_budget is not None:
        return mem_budget
    return max(m.mem_available - OUR_RAM_HEADROOM - sizes.kv_per_token * ctx - RUNTIME_BYTES, 0)


def _gpu_layers(sizes: PlanSizes, gpu_budget: int) -> tuple[int, int]:
    """Leading whole layers that fit the GPU budget, and their bytes (the seed's layer order)."""
    n = used = 0
    for i in range(sizes.n_layers):
        per_expert = (sizes.gpu_expert_bytes or sizes.expert_bytes)[i]
        need = sizes.layer_dense_bytes[i] + sizes.n_experts[i] * per_expert
        if used + need > gpu_budget:
            break
        used += need
        n += 1
    return n, used


def plan(sizes: PlanSizes, m: Machine, mem_budget: int | None = None, gpu_budget: int | None = None,
         ctx: int = DEFAULT_CTX, usage=None) -> PlanResult:
    """The expert-granular plan. `mem_budget`: RAM for weights (None: from MemAvailable);
    `usage`: a usage.Usage with recorded routing counts, or None."""
    if gpu_budget is None:
        gpu_budget = max((m.vram_free or 0) - VRAM_HEADROOM, 0)
    # No CUDA device: no GPU layers, whatever --gpu-budget says (the Engine would refuse them).
    n_gpu, gpu_bytes = _gpu_layers(sizes, gpu_budget) if m.vram_free is not None else (0, 0)
    budget = weights_budget(m, sizes, mem_budget, ctx)
    rest = range(n_gpu, sizes.n_layers)
    dense = sizes.global_dense_bytes + sum(sizes.layer_dense_bytes[i] for i in rest)
    experts_all = sum(sizes.layer_experts_bytes(i) for i in rest)
    layers = [LayerPlan("gpu", sizes.n_experts[i]) for i in range(n_gpu)]
    notes: list[str] = []
    cache = 0
    if dense + experts_all <= budget:  # everything fits: no disk tier, no cache bookkeeping
        layers += [LayerPlan("ram", sizes.n_experts[i]) for i in rest]
        dense += experts_all
    else:
        moe = [i for i in rest if sizes.n_experts[i]]
        layers += [LayerPlan("disk" if sizes.n_experts[i] else "ram") for i in rest]
        if moe:
            # One cache for all disk layers, slots of the largest expert (as the TieredStore builds it).
            slot = max(sizes.expert_bytes[i] for i in moe)
            n_slots = min(max(budget - dense, 0) // slot, sum(sizes.n_experts[i] for i in moe))
            _fill_slots(sizes, layers, moe, n_slots, usage)
            cache = n_slots * slot
            if n_slots < 1:
                notes.append(f"the budget ({_gib(budget)}) does not hold the dense weights and one expert "
                             f"({_gib(dense + slot)}): colibri run will refuse it")
            elif n_slots < sizes.top_k * len(moe):
                notes.append(f"fewer cache slots ({n_slots}) than top_k x disk layers "
                             f"({sizes.top_k * len(moe)}): most routed experts are re-read every token")
    disk_tok = ram_tok = 0.0
    for i in rest:
        ram_tok += sizes.active_bytes(i)
        if layers[i].tier == "disk":
            disk_tok += min(sizes.top_k, sizes.n_experts[i]) * (1 - layers[i].hit) * sizes.record_bytes[i]
    ram_tok += sizes.global_active
    budgeted = mem_budget is not None or cache > 0
    return PlanResult("expert-granular", layers, budget, gpu_budget, dense, gpu_bytes, cache, disk_tok,
                      ram_tok, m.disk_bps, m.ram_bps, notes, budgeted)


def _fill_slots(sizes: PlanSizes, layers: list[LayerPlan], moe: list[int], n_slots: int, usage) -> None:
    """Pin the hottest experts (with counts), then share the other slots evenly, like the store's
    "fair" cache policy. Sets each layer's slots, pinned experts and expected hit rate.

    Under uniform routing any split of slots gives the same expected hits, so nothing is pinned.
    With counts, an expert is worth pinning when it is routed more often than the layer's
    average (top_k / E): its slot then earns more than an LRU slot would under independent
    routing. The hottest pairs of the whole model go first, up to PIN_SHARE of the slots; the
    rest stay LRU, which also catches the token-to-token locality counts cannot see.
    """
    n_pin = 0
    if usage is not None:
        pairs = sorted((-usage.prob(i, e), i, e) for i in moe for e in range(sizes.n_experts[i])
                       if usage.prob(i, e) > sizes.top_k / sizes.n_experts[i])
        limit = min(int(n_slots * PIN_SHARE), n_slots - 1)  # the store keeps one slot unpinned
        for _p, i, e in pairs[: max(limit, 0)]:
            layers[i].pinned.append(e)
            n_pin += 1
    free = n_slots - n_pin
    for j, i in enumerate(moe):
        lp, E = layers[i], sizes.n_experts[i]
        share = free // len(moe) + (1 if j < free % len(moe) else 0)
        lp.slots = min(len(lp.pinned) + share, E)
        lru = lp.slots - len(lp.pinned)
        if usage is None:
            lp.hit = lp.slots / E
        else:
            mass = min(sum(usage.prob(i, e) for e in lp.pinned) / sizes.top_k, 1.0)  # routings pinned
            rest = E - len(lp.pinned)
            # LRU slots over the unpinned experts, modelled as uniform among them.
            lp.hit = min(mass + (1 - mass) * (lru / rest if rest else 0.0), 1.0)


def seed_plan(sizes: PlanSizes, m: Machine, mem_budget: int | None = None, gpu_budget: int | None = None,
              ctx: int = DEFAULT_CTX) -> PlanResult:
    """The seed's hand formula: whole layers into (free VRAM - 1 GiB), then (free RAM - 4 GiB), rest
    on disk with no expert cache (each token reads its top_k experts of every disk layer).

    Free RAM is MemAvailable; with --mem-budget, the memory the process would have under it
    (budget + KV cache + runtime), so both plans get the same memory."""
    free_vram = gpu_budget if gpu_budget is not None else (m.vram_free or 0)
    kv_rt = sizes.kv_per_token * ctx + RUNTIME_BYTES
    free_ram = mem_budget + kv_rt if mem_budget is not None else m.mem_available
    n_gpu, gpu_bytes = (0, 0)
    if m.vram_free is not None:
        n_gpu, gpu_bytes = _gpu_layers(sizes, max(free_vram - SEED_VRAM_HEADROOM, 0))
    room = free_ram - SEED_RAM_HEADROOM - sizes.global_dense_bytes
    layers = [LayerPlan("gpu", sizes.n_experts[i]) for i in range(n_gpu)]
    disk_tok = ram_tok = 0.0
    resident = sizes.global_dense_bytes
    for i in range(n_gpu, sizes.n_layers):
        ram_tok += sizes.active_bytes(i)
        if sizes.layer_bytes(i) <= room:
            room -= sizes.layer_bytes(i)
            layers.append(LayerPlan("ram", sizes.n_experts[i]))
            resident += sizes.layer_bytes(i)
        else:
            room = -1  # layers go in order: once one misses, the rest are disk layers
            layers.append(LayerPlan("disk", 0, hit=0.0))
            resident += sizes.layer_dense_bytes[i]
            disk_tok += min(sizes.top_k, sizes.n_experts[i]) * sizes.record_bytes[i]
    ram_tok += sizes.global_active
    return PlanResult("seed formula", layers, free_ram - kv_rt, free_vram, resident, gpu_bytes, 0,
                      disk_tok, ram_tok, m.disk_bps, m.ram_bps)


def auto_placement(container, mem_budget: int | None = None, gpu_budget: int | None = None,
                   usage=None, machine: Machine | None = None, ctx: int = DEFAULT_CTX) -> Placement:
    """The Placement for `container` on this machine (header and /proc/meminfo only, no weight read)."""
    sizes = PlanSizes.from_container(container)
    return plan(sizes, machine or current_machine(), mem_budget, gpu_budget, ctx, usage).placement()


def placement_fn(container, ctx: int = DEFAULT_CTX, usage=None, machine: Machine | None = None):
    """A store PlacementFn `(sizes, mem_budget, gpu_budget) -> Placement` running the planner:
    what the Engine uses when no tier flags are given."""
    def place(_sizes: ModelSizes, mem_budget: int | None, gpu_budget: int | None) -> Placement:
        return auto_placement(container, mem_budget, gpu_budget, usage, machine, ctx)
    return place


# ----------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 4 else f"{n / MiB:.1f} MiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def describe(r: PlanResult, sizes: PlanSizes) -> list[str]:
    out = [f"{r.name}: {r.count('gpu')} GPU / {r.count('ram')} RAM / {r.count('disk')} disk layers"]
    if r.gpu_bytes:
        out.append(f"  GPU: layers 0..{r.count('gpu') - 1} ({_gib(r.gpu_bytes)} of {_gib(r.gpu_budget)})")
    what = "whole RAM layers + dense parts of disk layers" if r.name != "expert-granular" else (
        "every weight" if not r.count("disk") else "dense parts of every layer, embeddings, lm_head")
    out.append(f"  resident in RAM: {_gib(r.resident)} of weights ({what})")
    disk = [lp for lp in r.layers if lp.tier == "disk"]
    if disk and r.cache_bytes:
        slots = sorted({lp.slots for lp in disk})
        s = f"{slots[0]}" if len(slots) == 1 else f"{slots[0]}..{slots[-1]}"
        hit = sum(lp.hit for lp in disk) / len(disk)
        out.append(f"  expert cache: {_gib(r.cache_bytes)} = {s} slots per disk layer "
                   f"(of {max(sizes.n_experts)} experts), expected hit rate {hit:.1%}")
    elif disk:
        out.append("  expert cache: none (disk layers read their top_k experts every token)")
    out.append(f"  per token: {_gb(r.disk_per_token)} from disk, {_gb(r.ram_per_token)} through RAM")
    d = r.disk_per_token / max(r.disk_bps, 1.0)
    ram_ms = r.ram_per_token / r.ram_bps * 1e3
    out.append(f"  bound: {r.tok_s:.2f} tok/s (disk {d * 1e3:.1f} ms + RAM {ram_ms:.1f} ms per token)")
    out += [f"  note: {n}" for n in r.notes]
    return out


def report(sizes: PlanSizes, m: Machine, mem_budget: int | None, gpu_budget: int | None, ctx: int,
           usage=None, top: int = 8) -> str:
    ours = plan(sizes, m, mem_budget, gpu_budget, ctx, usage)
    seed = seed_plan(sizes, m, mem_budget, gpu_budget, ctx)
    moe = sizes.moe_layers
    eb = max(sizes.record_bytes) if moe else 0
    kv = sizes.kv_per_token * ctx
    lines = [
        f"model: {sizes.model_type} {sizes.scheme}, {sizes.n_layers} layers, {max(sizes.n_experts)} experts "
        f"(top-{sizes.top_k}) in {len(moe)} layers; in RAM {_gib(sizes.total_bytes)} = dense "
        f"{_gib(sizes.dense_bytes)} + experts {_gib(sizes.total_bytes - sizes.dense_bytes)} "
        f"({eb / MiB:.2f} MiB each on disk)",
        f"machine: MemAvailable {_gib(m.mem_available)}, MemFree {_gib(m.mem_free)}, GPU "
        + (f"{_gib(m.vram_free)} free" if m.vram_free is not None else "none")
        + f", disk {m.disk_bps / 1e9:.2f} GB/s ({m.disk_note}), RAM {m.ram_bps / 1e9:.0f} GB/s (assumed)",
        f"budget for weights: {_gib(ours.weights_budget)} "
        + ("(--mem-budget)" if mem_budget is not None else
           f"(MemAvailable - {_gib(OUR_RAM_HEADROOM)} headroom - KV {_gib(kv)} for ctx {ctx} - runtime "
           f"{_gib(RUNTIME_BYTES)})"),
        "",
    ]
    lines += describe(ours, sizes) + [""] + describe(seed, sizes) + [""]
    lines.append(_verdict(ours, seed, sizes))
    if usage is not None:
        lines += ["", f"learned hot set ({usage.path}, {usage.total_tokens()} routed tokens):"]
        for i in moe:
            hot = usage.hottest(i, top)
            share = sum(usage.prob(i, e) for e in hot) / sizes.top_k
            lp = ours.layers[i]
            lines.append(f"  layer {i:3d}: top {len(hot)} {hot} carry {share:.0%} of routings; "
                         f"{lp.tier}, {len(lp.pinned)} pinned + {lp.slots - len(lp.pinned)} LRU slots, "
                         f"expected hit {lp.hit:.0%}")
    return "\n".join(lines)


def _verdict(ours: PlanResult, seed: PlanResult, sizes: PlanSizes) -> str:
    if ours.disk_per_token == 0 and seed.disk_per_token == 0:
        return "verdict: the model fits; both plans keep every weight in memory."
    gain = ours.tok_s / seed.tok_s if seed.tok_s else math.inf
    why = []
    used = ours.resident + ours.cache_bytes - seed.resident
    if used > 0:
        layer = max(sizes.layer_bytes(i) for i in range(sizes.n_layers))
        why.append(f"it puts {_gib(used)} more memory to work for weights (the seed keeps "
                   f"{_gib(SEED_RAM_HEADROOM)} headroom and rounds down to whole layers of {_gib(layer)})")
    if ours.cache_bytes:
        why.append("disk layers keep an expert cache, so experts routed again are not re-read")
    if any(lp.pinned for lp in ours.layers):
        why.append("experts hot in past runs are pinned, which beats uniform slots")
    return (f"verdict: expert-granular reads {_gb(ours.disk_per_token)}/token vs {_gb(seed.disk_per_token)}; "
            f"bound {ours.tok_s:.2f} vs {seed.tok_s:.2f} tok/s ({gain:.2f}x): " + "; ".join(why or ["same"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colibri plan", description="Print the placement colibri would use for "
                                "a model on this machine (reads only the header and ~0.5 s of disk).")
    p.add_argument("--model", "-m", required=True, help="path to a .coli container")
    p.add_argument("--mem-budget", help="RAM for weights (dense + expert cache), as for colibri run, e.g. "
                   "3G; default: MemAvailable - 1 GiB - KV cache - runtime")
    p.add_argument("--gpu-budget", help="VRAM to use, e.g. 6G; default: free VRAM - 1 GiB")
    p.add_argument("--ctx-size", "-c", type=int, default=DEFAULT_CTX, help="context length (KV cache size)")
    p.add_argument("--usage-file", help="routing counts recorded by `colibri run --usage-file`: "
                   "pin hot experts")
    p.add_argument("--disk-speed", help="skip the read probe and assume this many bytes/s (e.g. 2G)")
    p.add_argument("--probe-seconds", type=float, default=0.5, help="length of the disk read probe")
    a = p.parse_args(argv)
    from .container import Container

    if not os.path.exists(a.model):
        raise ColibriError(f"model file {a.model} not found")
    with Container(a.model) as c:
        sizes = PlanSizes.from_container(c)
    usage = None
    if a.usage_file:
        from .usage import Usage

        usage = Usage.load(a.usage_file, sizes.n_experts)
        if usage.total_tokens() == 0:
            print(f"colibri plan: {a.usage_file} has no recorded routing yet: planning for uniform routing",
                  file=sys.stderr)
            usage = None
    if a.disk_speed:
        m = current_machine()
        m.disk_bps, m.disk_note = float(parse_size(a.disk_speed)), "--disk-speed"
    else:
        m = probe_machine(a.model, a.probe_seconds, max(max(sizes.record_bytes, default=0), 4096))
    mem = parse_size(a.mem_budget) if a.mem_budget else None
    gpu = parse_size(a.gpu_budget) if a.gpu_budget else None
    print(report(sizes, m, mem, gpu, a.ctx_size, usage))
    return 0
