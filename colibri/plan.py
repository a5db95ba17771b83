"""The placement planner: `colibri plan` and `auto_placement()` (what the Engine uses by default).

It reads only the container header (sizes, never weight data) and the machine (MemAvailable,
free VRAM, a ~0.5 s O_DIRECT read-speed probe of the container itself), then decides per layer:
GPU or RAM-resident, or disk with an expert cache of N slots. All dense weights (attention,
routers, norms, embeddings, lm_head) stay resident: they are a few percent of an MoE model and
every token needs all of them, whereas a token touches only top_k of E experts per layer.

The cost model per token:
    disk bytes = sum over disk layers of top_k * (1 - hit) * expert_bytes
    RAM bytes  = all resident dense bytes + top_k * expert_bytes per non-GPU MoE layer
    tok/s bound = 1 / (disk bytes / disk speed + RAM bytes / RAM bandwidth)
hit = slots / E under uniform routing, or from recorded routing counts (--usage-file).
The seed's hand formula (whole layers vs free memory, fixed headroom, no cache) is the baseline.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import re
import sys
import time
from dataclasses import dataclass, field

from .errors import ColibriError
from .store.placement import Placement, parse_size

GiB, MiB = 1 << 30, 1 << 20
RAM_BPS = 18e9  # CPU memory bandwidth a decode step sustains on this class of machine (STREAM-like)
RUNTIME_BYTES = 512 * MiB  # python + torch + tokenizer RSS before any weight (measured ~400 MiB)
OUR_RAM_HEADROOM = 1 * GiB  # left to the OS and other programs when planning from MemAvailable
SEED_RAM_HEADROOM, SEED_VRAM_HEADROOM = 4 * GiB, 1 * GiB  # the seed's hand formula
VRAM_HEADROOM = 1 * GiB  # CUDA context + activations
PIN_SHARE = 0.75  # share of a layer's slots given to pinned hot experts; the rest stays LRU (recency)
DEFAULT_CTX = 4096
_EXPERT_RECORD = re.compile(r"^model\.layers\.(\d+)\..*experts\.(\d+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class ModelSizes:
    """Byte sizes from a container header: what the planner needs, nothing else."""

    n_layers: int
    top_k: int
    experts: list[int]  # per layer: routed experts (0 for dense layers)
    expert_bytes: list[int]  # per layer: bytes of one expert record (the largest, to be safe)
    layer_dense: list[int]  # per layer: attention, norms, router, shared experts
    global_bytes: int  # embedding, final norm, lm_head
    embed_bytes: int  # part of global_bytes; a token reads one row of it, not all
    embed_row: int
    kv_per_token: int  # KV cache bytes per context position (all layers)
    scheme: str = "?"
    model_type: str = "?"

    @classmethod
    def from_header(cls, header: dict, kv_per_token: int | None = None) -> ModelSizes:
        meta = header.get("meta") or {}
        cfg = meta.get("config") or {}
        tensors, records = header["tensors"], header["records"]
        layer_ids = [int(m[1]) for n in tensors if (m := _LAYER.match(n))]
        n = max(layer_ids) + 1 if layer_ids else int(cfg.get("num_hidden_layers", 0))
        experts, ebytes, dense = [0] * n, [0] * n, [0] * n
        for name, r in records.items():
            if m := _EXPERT_RECORD.match(name):
                i = int(m[1])
                experts[i] += 1
                ebytes[i] = max(ebytes[i], r["nbytes"])
        glob = embed = row = 0
        for name, e in tensors.items():
            if "record" in e:
                continue
            if m := _LAYER.match(name):
                dense[int(m[1])] += e["nbytes"]
            else:
                glob += e["nbytes"]
                if name.endswith("embed_tokens.weight"):
                    embed, row = e["nbytes"], e["nbytes"] // max(e["shape"][0], 1)
        if kv_per_token is None:
            kv_per_token = _kv_formula(cfg, n)
        top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 2)
        return cls(n, top_k, experts, ebytes, dense, glob, embed, row, kv_per_token,
                   (meta.get("quant") or {}).get("scheme", "?"), meta.get("model_type", "?"))

    @classmethod
    def from_container(cls, c) -> ModelSizes:
        return cls.from_header(c.header, _kv_measured(c))

    @property
    def dense_bytes(self) -> int:
        return self.global_bytes + sum(self.layer_dense)

    def layer_bytes(self, i: int) -> int:
        return self.layer_dense[i] + self.experts[i] * self.expert_bytes[i]

    @property
    def total_bytes(self) -> int:
        return self.global_bytes + sum(self.layer_bytes(i) for i in range(self.n_layers))

    def active_bytes(self, i: int) -> int:
        """Bytes a decode token touches in layer i: its dense part and top_k experts."""
        return self.layer_dense[i] + min(self.top_k, self.experts[i]) * self.expert_bytes[i]

    @property
    def global_active(self) -> int:
        return self.global_bytes - self.embed_bytes + self.embed_row


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
    except Exception:  # an unknown family still gets a plan, from the formula
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


def measure_disk(path: str, seconds: float = 0.5, chunk: int = 4 * MiB) -> tuple[float, str]:
    """Read speed of `path`'s device: random aligned O_DIRECT reads of expert-record size.

    O_DIRECT bypasses the page cache, so this is the device, not RAM, whatever was read before.
    Falls back to buffered reads where O_DIRECT is refused (tmpfs), and says so.
    """
    size = os.path.getsize(path)
    chunk = max(4096, min(chunk, size // 4096 * 4096) // 4096 * 4096)
    note = "O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd, note = os.open(path, os.O_RDONLY), "buffered (O_DIRECT refused; may be page-cache speed)"
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    rng = __import__("random").Random(0)
    slots = max(size // chunk - 1, 1)
    done, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            off = rng.randrange(slots) * chunk
            try:
                n = os.preadv(fd, [buf], off)
            except OSError:  # O_DIRECT with an unaligned tail or odd filesystem: go buffered
                os.close(fd)
                fd, note = os.open(path, os.O_RDONLY), "buffered (O_DIRECT failed; may be page-cache speed)"
                continue
            done += n
    finally:
        os.close(fd)
        buf.close()
    dt = time.perf_counter() - t0
    return (done / dt if dt > 0 else 0.0), f"{note}, {seconds:.1f} s of {chunk / MiB:.1f} MiB random reads"


def probe_machine(path: str, seconds: float = 0.5, chunk: int = 4 * MiB) -> Machine:
    mi = meminfo()
    vram = None
    try:
        import torch

        if torch.cuda.is_available():
            vram = torch.cuda.mem_get_info()[0]
    except Exception:  # a broken CUDA install plans as CPU-only
        vram = None
    bps, note = measure_disk(path, seconds, chunk)
    return Machine(mi.get("MemAvailable", 0), mi.get("MemFree", 0), vram, bps, RAM_BPS, note)


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
    ram_budget: int  # what the plan may use in RAM (weights + cache + KV + runtime)
    gpu_budget: int
    dense_resident: int  # weights resident in RAM outside the expert cache (dense + whole RAM layers)
    gpu_bytes: int
    cache_bytes: int  # expert cache in RAM (disk layers)
    disk_per_token: float
    ram_per_token: float
    disk_bps: float
    ram_bps: float
    notes: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        t = self.disk_per_token / max(self.disk_bps, 1.0) + self.ram_per_token / self.ram_bps
        return 1.0 / t if t > 0 else math.inf

    def count(self, tier: str) -> int:
        return sum(lp.tier == tier for lp in self.layers)

    def placement(self) -> Placement:
        """The store's Placement: tiers, the RAM/GPU expert-cache bounds, pinned hot experts."""
        disk = self.count("disk")
        return Placement([lp.tier for lp in self.layers], mem_budget=self.cache_bytes if disk else None,
                         gpu_budget=self.gpu_budget or None,
                         pinned={i: lp.pinned for i, lp in enumerate(self.layers) if lp.pinned})


def _ram_budget(m: Machine, sizes: ModelSizes, mem_budget: int | None, ctx: int) -> tuple[int, int]:
    """(bytes for weights and cache, total budget): the budget minus KV cache and runtime."""
    total = mem_budget if mem_budget is not None else max(m.mem_available - OUR_RAM_HEADROOM, 0)
    return total - sizes.kv_per_token * ctx - RUNTIME_BYTES, total


def _gpu_layers(sizes: ModelSizes, gpu_budget: int) -> tuple[int, int]:
    """Leading whole layers that fit the GPU budget, and their bytes (the seed's layer order)."""
    n = used = 0
    for i in range(sizes.n_layers):
        if used + sizes.layer_bytes(i) > gpu_budget:
            break
        used += sizes.layer_bytes(i)
        n += 1
    return n, used


def plan(sizes: ModelSizes, m: Machine, mem_budget: int | None = None, gpu_budget: int | None = None,
         ctx: int = DEFAULT_CTX, usage=None) -> PlanResult:
    """The expert-granular plan. `usage`: a usage.Usage with recorded routing counts, or None."""
    if gpu_budget is None:
        gpu_budget = max((m.vram_free or 0) - VRAM_HEADROOM, 0)
    # No CUDA device: no GPU layers, whatever --gpu-budget says (the Engine would refuse them).
    n_gpu, gpu_bytes = _gpu_layers(sizes, gpu_budget) if m.vram_free is not None else (0, 0)
    weights, total = _ram_budget(m, sizes, mem_budget, ctx)
    rest = range(n_gpu, sizes.n_layers)
    dense = sizes.global_bytes + sum(sizes.layer_dense[i] for i in rest)
    experts_all = sum(sizes.experts[i] * sizes.expert_bytes[i] for i in rest)
    layers = [LayerPlan("gpu", sizes.experts[i]) for i in range(n_gpu)]
    notes: list[str] = []
    if dense + experts_all <= weights:  # everything fits: no disk tier, no cache bookkeeping
        layers += [LayerPlan("ram", sizes.experts[i]) for i in rest]
        cache, dense = 0, dense + experts_all
    else:
        cache = max(weights - dense, 0)
        moe = [i for i in rest if sizes.experts[i]]
        layers += [LayerPlan("disk" if sizes.experts[i] else "ram") for i in rest]
        _fill_slots(sizes, layers, moe, cache, usage)
        cache = sum(layers[i].slots * sizes.expert_bytes[i] for i in moe)
        short = [i for i in moe if layers[i].slots < sizes.top_k]
        if weights < dense:
            notes.append(f"the budget leaves {_gib(weights)} for weights, below the dense weights "
                         f"({_gib(dense)}): expect the OS to page dense weights in and out")
        elif short:
            notes.append(f"{len(short)} layers get fewer slots than top_k={sizes.top_k}: every token "
                         "re-reads experts within a layer; raise --mem-budget")
    disk_tok = ram_tok = 0.0
    for i in rest:
        lp = layers[i]
        ram_tok += sizes.active_bytes(i)
        if lp.tier == "disk":
            disk_tok += min(sizes.top_k, sizes.experts[i]) * (1 - lp.hit) * sizes.expert_bytes[i]
    ram_tok += sizes.global_active
    return PlanResult("expert-granular", layers, total, gpu_budget, dense, gpu_bytes, cache, disk_tok, ram_tok,
                      m.disk_bps, m.ram_bps, notes)


def _fill_slots(sizes: ModelSizes, layers: list[LayerPlan], moe: list[int], cache: int, usage) -> None:
    """Split `cache` bytes into per-layer slots; pin the hottest experts first when counts exist.

    Under uniform routing any split gives the same expected hits per byte, so slots are spread
    evenly (a shared LRU converges to that too). With counts, a (layer, expert) pair is worth
    its routing probability per byte, so the hottest pairs of the whole model are pinned first.
    """
    if not moe:
        return
    per = {i: 0 for i in moe}
    left = cache
    if usage is not None:
        pairs = sorted(((usage.prob(i, e), i, e) for i in moe for e in range(sizes.experts[i])
                        if usage.prob(i, e) > 0), reverse=True)
        pin_budget = cache * PIN_SHARE
        for _p, i, e in pairs:
            if sizes.expert_bytes[i] > pin_budget:
                break
            pin_budget -= sizes.expert_bytes[i]
            left -= sizes.expert_bytes[i]
            layers[i].pinned.append(e)
    # Round-robin whole slots over the layers (layers differ in expert size only in odd models).
    progress = True
    while progress:
        progress = False
        for i in moe:
            if len(layers[i].pinned) + per[i] < sizes.experts[i] and sizes.expert_bytes[i] <= left:
                per[i] += 1
                left -= sizes.expert_bytes[i]
                progress = True
    for i in moe:
        lp, E = layers[i], sizes.experts[i]
        lp.slots = len(lp.pinned) + per[i]
        if usage is None:
            lp.hit = min(lp.slots / E, 1.0)
        else:
            mass = sum(usage.prob(i, e) for e in lp.pinned) / sizes.top_k  # share of routings pinned
            free = E - len(lp.pinned)
            # LRU slots over the unpinned experts, modelled as uniform among them.
            lp.hit = min(mass + (1 - mass) * (per[i] / free if free else 0.0), 1.0)


def seed_plan(sizes: ModelSizes, m: Machine, mem_budget: int | None = None, gpu_budget: int | None = None,
              ctx: int = DEFAULT_CTX) -> PlanResult:
    """The seed's hand formula: whole layers into (free VRAM - 1 GiB), then (free RAM - 4 GiB), rest
    on disk with no expert cache (each token reads its top_k experts of every disk layer)."""
    free_vram = gpu_budget if gpu_budget is not None else (m.vram_free or 0)
    free_ram = mem_budget if mem_budget is not None else m.mem_available
    n_gpu, gpu_bytes = _gpu_layers(sizes, max(free_vram - SEED_VRAM_HEADROOM, 0)) if free_vram else (0, 0)
    room = free_ram - SEED_RAM_HEADROOM - sizes.global_bytes
    layers = [LayerPlan("gpu", sizes.experts[i]) for i in range(n_gpu)]
    disk_tok = ram_tok = dense = 0.0
    for i in range(n_gpu, sizes.n_layers):
        ram_tok += sizes.active_bytes(i)
        if sizes.layer_bytes(i) <= room:
            room -= sizes.layer_bytes(i)
            layers.append(LayerPlan("ram", sizes.experts[i]))
            dense += sizes.layer_bytes(i)
        else:
            room = -1  # layers go in order: once one misses, the rest are disk layers
            layers.append(LayerPlan("disk", 0, hit=0.0))
            dense += sizes.layer_dense[i]
            disk_tok += min(sizes.top_k, sizes.experts[i]) * sizes.expert_bytes[i]
    ram_tok += sizes.global_active
    return PlanResult("seed formula", layers, free_ram, free_vram, int(dense + sizes.global_bytes), gpu_bytes, 0,
                      disk_tok, ram_tok, m.disk_bps, m.ram_bps)


def auto_placement(container, mem_budget: int | None = None, gpu_budget: int | None = None,
                   usage=None, machine: Machine | None = None, ctx: int = DEFAULT_CTX) -> Placement:
    """The Placement the Engine uses when no tier flags are given (header and machine only)."""
    sizes = ModelSizes.from_container(container)
    if machine is None:
        mi = meminfo()
        vram = None
        try:
            import torch

            if torch.cuda.is_available():
                vram = torch.cuda.mem_get_info()[0]
        except Exception:
            vram = None
        # Disk speed does not change the placement (only its predicted speed): skip the probe.
        machine = Machine(mi.get("MemAvailable", 0), mi.get("MemFree", 0), vram, 1e9, RAM_BPS, "not measured")
    return plan(sizes, machine, mem_budget, gpu_budget, ctx, usage).placement()


# ----------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 4 else f"{n / MiB:.1f} MiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def describe(r: PlanResult, sizes: ModelSizes) -> list[str]:
    out = [f"{r.name}: {r.count('gpu')} GPU / {r.count('ram')} RAM / {r.count('disk')} disk layers"]
    if r.gpu_bytes:
        out.append(f"  GPU: layers 0..{r.count('gpu') - 1} ({_gib(r.gpu_bytes)} of {_gib(r.gpu_budget)})")
    what = "whole RAM layers + dense parts of disk layers" if r.name != "expert-granular" else (
        "every weight" if not r.count("disk") else "dense parts of every layer, embeddings, lm_head")
    out.append(f"  resident in RAM: {_gib(r.dense_resident)} of weights ({what})")
    disk = [lp for lp in r.layers if lp.tier == "disk"]
    if disk and r.cache_bytes:
        slots = sorted({lp.slots for lp in disk})
        s = f"{slots[0]}" if len(slots) == 1 else f"{slots[0]}..{slots[-1]}"
        hit = sum(lp.hit for lp in disk) / len(disk)
        out.append(f"  expert cache: {_gib(r.cache_bytes)} = {s} slots per disk layer "
                   f"(of {max(sizes.experts)} experts), expected hit rate {hit:.1%}")
    elif disk:
        out.append("  expert cache: none (disk layers read their top_k experts every token)")
    out.append(f"  per token: {_gb(r.disk_per_token)} from disk, {_gb(r.ram_per_token)} through RAM")
    d = r.disk_per_token / max(r.disk_bps, 1.0)
    out.append(f"  bound: {r.tok_s:.2f} tok/s (disk {d * 1e3:.1f} ms + RAM {r.ram_per_token / r.ram_bps * 1e3:.1f} ms"
               " per token)")
    out += [f"  note: {n}" for n in r.notes]
    return out


def report(sizes: ModelSizes, m: Machine, mem_budget: int | None, gpu_budget: int | None, ctx: int,
           usage=None, top: int = 8) -> str:
    ours = plan(sizes, m, mem_budget, gpu_budget, ctx, usage)
    seed = seed_plan(sizes, m, mem_budget, gpu_budget, ctx)
    moe = [i for i in range(sizes.n_layers) if sizes.experts[i]]
    eb = max(sizes.expert_bytes) if moe else 0
    lines = [
        f"model: {sizes.model_type} {sizes.scheme}, {sizes.n_layers} layers, {max(sizes.experts)} experts "
        f"(top-{sizes.top_k}) in {len(moe)} layers; {_gib(sizes.total_bytes)} total = dense "
        f"{_gib(sizes.dense_bytes)} + experts {_gib(sizes.total_bytes - sizes.dense_bytes)} "
        f"({eb / MiB:.2f} MiB each)",
        f"machine: MemAvailable {_gib(m.mem_available)}, MemFree {_gib(m.mem_free)}, GPU "
        + (f"{_gib(m.vram_free)} free" if m.vram_free is not None else "none")
        + f", disk {m.disk_bps / 1e9:.2f} GB/s ({m.disk_note}), RAM {m.ram_bps / 1e9:.0f} GB/s (assumed)",
        f"budget: RAM {_gib(ours.ram_budget)} "
        + ("(--mem-budget)" if mem_budget is not None else f"(MemAvailable - {_gib(OUR_RAM_HEADROOM)} headroom)")
        + f" = KV {_gib(sizes.kv_per_token * ctx)} (ctx {ctx}) + runtime {_gib(RUNTIME_BYTES)} + weights",
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


def _verdict(ours: PlanResult, seed: PlanResult, sizes: ModelSizes) -> str:
    if ours.disk_per_token == 0 and seed.disk_per_token == 0:
        return "verdict: the model fits; both plans keep every weight in memory."
    gain = ours.tok_s / seed.tok_s if seed.tok_s else math.inf
    why = []
    seed_mem = seed.dense_resident
    ours_mem = ours.dense_resident + ours.cache_bytes
    if ours_mem > seed_mem:
        why.append(f"it puts {_gib(ours_mem - seed_mem)} more of the same budget to work (the seed keeps "
                   f"{_gib(SEED_RAM_HEADROOM)} headroom and rounds down to whole layers of "
                   f"{_gib(max(sizes.layer_bytes(i) for i in range(sizes.n_layers)))})")
    if ours.cache_bytes:
        why.append("every disk layer keeps a cache, so repeated experts are not re-read")
    if any(lp.pinned for lp in ours.layers):
        why.append("hot experts from the usage file are pinned, which beats uniform slots")
    return (f"verdict: expert-granular reads {_gb(ours.disk_per_token)}/token vs {_gb(seed.disk_per_token)}; "
            f"bound {ours.tok_s:.2f} vs {seed.tok_s:.2f} tok/s ({gain:.2f}x): " + "; ".join(why or ["same"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colibri plan", description="Print the placement colibri would use for "
                                "a model on this machine (reads only the header and ~0.5 s of disk).")
    p.add_argument("--model", "-m", required=True, help="path to a .coli container")
    p.add_argument("--mem-budget", help="RAM for colibri (weights, expert cache, KV, runtime), e.g. 3G; "
                   "default: MemAvailable - 1 GiB")
    p.add_argument("--gpu-budget", help="VRAM to use, e.g. 6G; default: free VRAM - 1 GiB")
    p.add_argument("--ctx-size", "-c", type=int, default=DEFAULT_CTX, help="context length (KV cache size)")
    p.add_argument("--usage-file", help="routing counts recorded by `colibri run --usage-file`: pin hot experts")
    p.add_argument("--disk-speed", help="skip the read probe and assume this many bytes/s (e.g. 2G)")
    p.add_argument("--probe-seconds", type=float, default=0.5, help="length of the disk read probe")
    a = p.parse_args(argv)
    from .container import Container

    if not os.path.exists(a.model):
        raise ColibriError(f"model file {a.model} not found")
    with Container(a.model) as c:
        sizes = ModelSizes.from_container(c)
    usage = None
    if a.usage_file:
        from .usage import Usage

        usage = Usage.load(a.usage_file, sizes.experts)
        if usage.total_tokens() == 0:
            print(f"colibri plan: {a.usage_file} has no recorded routing yet: planning for uniform routing",
                  file=sys.stderr)
            usage = None
    if a.disk_speed:
        m = probe_machine(a.model, 0.0)
        m.disk_bps, m.disk_note = float(parse_size(a.disk_speed)), "--disk-speed"
    else:
        m = probe_machine(a.model, a.probe_seconds, max(max(sizes.expert_bytes), 4096))
    mem = parse_size(a.mem_budget) if a.mem_budget else None
    gpu = parse_size(a.gpu_budget) if a.gpu_budget else None
    print(report(sizes, m, mem, gpu, a.ctx_size, usage))
    return 0
