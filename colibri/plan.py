"""The placement planner: the one place that decides which layer lives where (`colibri plan`,
and `placement_fn()`, what the Engine uses when no tier flags are given).

It reads only the container header (sizes, never weight data) and the machine (probe.py: free
memory and VRAM; for `colibri plan` also the disk's read speed, the matrix-vector speed and the
cost of one torch op), then decides per layer: GPU or RAM-resident, or disk with a share of one
expert cache. All dense weights (attention, routers, norms, embeddings, lm_head) stay resident:
they are a few percent of an MoE model and every token needs all of them, whereas a token
touches only top_k of E experts per layer.

Byte accounting is the store's own (`store.sizes.model_sizes`), so a plan's budget is exactly
what `colibri run --mem-budget` would hold. The speed estimate per decode token:
    disk bytes = sum over disk layers of top_k * (1 - hit) * expert record bytes
    RAM bytes  = resident dense bytes + top_k * expert record bytes per non-GPU MoE layer
    ops        = torch operations of one forward (OPS_* below: counted on the demo model)
    tok/s     ~= 1 / (disk bytes / disk speed + RAM bytes / matvec speed + ops * op cost * PY_PER_OP)
hit = slots / E under uniform routing, or from recorded routing counts (--usage-file). A model whose
decode step is one native call (int8/int4, every layer in RAM, a family shape the call runs:
engine/native_step.py `one_call_shape`) has no per-op cost; its step costs
    RAM bytes / (ONE_CALL_BW_SHARE[scheme] * matvec speed) + ONE_CALL_LAYER_S per layer.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field, fields

from .analysis.probe import GiB, Machine, MiB, current_machine, probe_machine
from .analysis.usage import Usage
from .errors import ColibriError
from .store.placement import Placement, parse_size
from .store.sizes import ModelSizes, model_sizes, mtp_bytes

RUNTIME_BYTES = 512 * MiB  # python + torch + tokenizer RSS before any weight (measured ~400 MiB)
OUR_RAM_HEADROOM = 1 * GiB  # left to the OS and other programs when planning from MemAvailable
# Under a memory cgroup's limit (a container's) the OS is not charged to it: a little slack for the page
# cache the cgroup's reads go through (with --mem-budget 2900M under a 3500M cap the rest peaked at ~450 MiB,
# inside RUNTIME_BYTES)
CGROUP_HEADROOM = 256 * MiB
VRAM_HEADROOM = 1 * GiB  # CUDA context + activations
PIN_SHARE = 0.75  # at most this share of the cache's slots is pinned; the rest stays LRU (recency)
DEFAULT_CTX = 4096
# Torch operations of one decode step (TorchDispatchMode count over the engine's step on the demo
# model, mixtral top-2: 487 = 25 + 4 x 115; a layer is attention 57 + norms and residuals 18 +
# router, expert and batching bookkeeping 22 + 8 per routed expert; a dense MLP layer ~6).
OPS_GLOBAL, OPS_LAYER, OPS_MOE, OPS_EXPERT, OPS_MLP = 25, 75, 22, 8, 6
# Each op of a real step costs several times a bare op in a tight loop (the Python of modules and
# of the engine around it): 3.2x to 8.8x on the demo model (1 thread, a shared VM at load 6-8);
# the geometric middle keeps the estimate within 2x of `colibri bench` over that whole range.
PY_PER_OP = 5.5
# The one-call step (measured with 2 threads on the demo model and OLMoE shapes, each against these
# estimates): its weight stream runs at ~0.75 (int4) / ~0.55 (int8) of the probe's matvec speed, and the
# rest of a step (the engine's Python between steps; each layer's norms, rotary, attention, router) costs
# ~0.15 ms per layer: demo int4 0.49 ms a token (estimate 0.6), 0.44b int4 3.8 (3.9), 0.44b int8 7.3
# (7.4), 7b int4 32-46 depending on the VM's stretch (37.6).
ONE_CALL_BW_SHARE = {"int4": 0.75, "int8": 0.55}
ONE_CALL_LAYER_S = 0.15e-3

@dataclass
class PlanSizes(ModelSizes):
    """The store's ModelSizes (memory costs, same accounting as the TieredStore that will run the
    plan) plus what only the cost model needs: the embedding's size and row, the KV cache."""

    embed_bytes: int = 0  # in global_dense_bytes; a token reads one row of it, not all
    embed_row: int = 0
    kv_per_token: int = 0  # KV cache bytes per context position (all layers)
    kv_fixed: int = 0  # a slot's bytes whatever its context (linear-attention states)
    kv_types: str = "bf16"  # the K/V cache's storage (layers/kvquant.py), as the report names it
    scheme: str = "?"
    model_type: str = "?"
    one_call: bool = False  # int8/int4 and a layer shape the one-call decode step runs (when all in RAM)

    @classmethod
    def from_container(cls, c, kv_per_token: int | None = None, kv_types=None) -> PlanSizes:
        """From a Container, or anything with its `header`, `config` and `quant` (tests use stubs)."""
        base = model_sizes(c)
        embed = next((e for n, e in c.header["tensors"].items() if n.endswith("embed_tokens.weight")), None)
        model = _skeleton(c)
        kv, fixed = kv_per_token, 0
        if kv is None:
            kv, fixed = _kv_measured(model, kv_types) or (_kv_formula(c.config, base.n_layers), 0)
        scheme = c.quant.get("scheme", "?")
        return cls(**{f.name: getattr(base, f.name) for f in fields(ModelSizes)},
                   embed_bytes=embed["nbytes"] if embed else 0,
                   embed_row=embed["nbytes"] // max(embed["shape"][0], 1) if embed else 0,
                   kv_per_token=kv, kv_fixed=fixed, kv_types=str(_types(kv_types)), scheme=scheme,
                   model_type=(c.header.get("meta") or {}).get("model_type", "?"),
                   one_call=scheme in ("int8", "int4") and model is not None and _one_call_shape(model))

    def kv_bytes(self, ctx: int, slots: int) -> int:
        return (self.kv_per_token * ctx + self.kv_fixed) * slots

    def layer_bytes(self, i: int) -> int:
        return self.layer_dense_bytes[i] + self.layer_experts_bytes(i)

    def active_bytes(self, i: int) -> int:
        """Bytes a decode token touches in layer i: its dense part and top_k experts."""
        return self.layer_dense_bytes[i] + min(self.top_k, self.n_experts[i]) * self.record_bytes[i]

    @property
    def global_active(self) -> int:
        return self.global_dense_bytes - self.embed_bytes + self.embed_row


def _types(kv_types):
    from .layers.kvquant import KVTypes

    return KVTypes.of(kv_types)


def _kv_formula(cfg: dict, n_layers: int) -> int:
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 0) // heads)
    return 2 * n_layers * kv * hd * 2  # K and V, bf16


def _skeleton(c):
    """The family's model skeleton (placeholders, no weights), or None for an unknown family or a test stub."""
    try:
        from .models.base import build

        return build(c.model_type, c.config)[0]
    except Exception:  # an unknown family (or a test stub) still gets a plan, from the formulas
        return None


def _kv_measured(model, kv_types=None) -> tuple[int, int] | None:
    """(bytes per position, fixed bytes) of a slot from the family's own cache (MLA, sliding windows, linear
    attention's state, the K/V storage types); None if unknown."""
    if model is None:
        return None
    import torch

    from .layers.kvquant import KVTypes

    return model.cache_cost(torch.bfloat16, KVTypes.of(kv_types))


def _one_call_shape(model) -> bool:
    from .engine.native_step import one_call_shape

    return one_call_shape(model.model.layers)


@dataclass
class LayerPlan:
    tier: str  # gpu | ram | disk
    slots: int = 0  # expert cache slots (disk layers); all experts for resident ones
    pinned: list[int] = field(default_factory=list)
    hit: float = 1.0  # expected share of this layer's routed experts found in memory


@dataclass
class PlanResult:
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
    budgeted: bool = True  # False: everything fits unbounded, no budget handed to the store
    ops_per_token: int = 0  # torch ops of one decode forward
    op_s: float = 0.0  # one bare torch op on this machine (0: not measured)
    kv_bytes: int = 0  # all KV slots: slots x ctx x bytes per position
    one_call: float = 0.0  # the decode step is one native call: its weight stream's share of the matvec speed

    @property
    def seconds_per_token(self) -> tuple[float, float, float]:
        """(disk, RAM, overhead: per-op cost, or the one-call step's per-layer cost) seconds of one token."""
        disk = self.disk_per_token / max(self.disk_bps, 1.0)
        if self.one_call:
            return disk, self.ram_per_token / (self.one_call * self.ram_bps), ONE_CALL_LAYER_S * len(self.layers)
        return disk, self.ram_per_token / self.ram_bps, self.ops_per_token * self.op_s * PY_PER_OP

    @property
    def tok_s(self) -> float:
        t = sum(self.seconds_per_token)
        return 1.0 / t if t > 0 else math.inf

    def count(self, tier: str) -> int:
        return sum(lp.tier == tier for lp in self.layers)

    def placement(self) -> Placement:
        """The store's Placement: tiers, the RAM/GPU weight budgets, pinned hot experts."""
        return Placement([lp.tier for lp in self.layers],
                         mem_budget=self.weights_budget if self.budgeted else None,
                         gpu_budget=self.gpu_budget if self.count("gpu") else None,
                         pinned={i: lp.pinned for i, lp in enumerate(self.layers) if lp.pinned})


def weights_budget(m: Machine, sizes: PlanSizes, mem_budget: int | None, ctx: int, slots: int = 1) -> int:
    """RAM for weights: --mem-budget as given (as `colibri run` reads it), or what MemAvailable
    leaves after our headroom, the KV slots and the runtime."""
    if mem_budget is not None:
        return mem_budget
    return max(m.mem_available - headroom(m) - sizes.kv_bytes(ctx, slots) - RUNTIME_BYTES, 0)


def headroom(m: Machine) -> int:
    """What the plan leaves free: to the system, or within a container's memory limit to its page cache."""
    return CGROUP_HEADROOM if m.cgroup else OUR_RAM_HEADROOM


def ops_per_token(sizes: PlanSizes) -> int:
    """Torch operations of one decode forward (see OPS_*): what a small model's speed is made of."""
    n = OPS_GLOBAL + OPS_LAYER * sizes.n_layers
    for i in range(sizes.n_layers):
        E = sizes.n_experts[i]
        n += OPS_MOE + OPS_EXPERT * min(sizes.top_k, E) if E else OPS_MLP
    return n


def _gpu_layers(sizes: PlanSizes, gpu_budget: int) -> tuple[int, int]:
    """Leading whole layers that fit the GPU budget, and their bytes (layers go to the GPU in order)."""
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
         ctx: int = DEFAULT_CTX, usage: Usage | None = None, slots: int = 1) -> PlanResult:
    """The plan. `mem_budget`: RAM for weights (None: from MemAvailable less `slots` KV caches of
    `ctx` positions); `usage`: recorded routing counts, or None."""
    if gpu_budget is None:
        gpu_budget = max((m.vram_free or 0) - VRAM_HEADROOM, 0)
    # No CUDA device: no GPU layers, whatever --gpu-budget says (the Engine would refuse them).
    n_gpu, gpu_bytes = _gpu_layers(sizes, gpu_budget) if m.vram_free is not None else (0, 0)
    budget = weights_budget(m, sizes, mem_budget, ctx, slots)
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
        elif not sizes.moe_layers:  # (no expert to leave on disk: every weight stays in memory)
            notes.append(f"the budget ({_gib(budget)}) does not hold the weights ({_gib(dense)}) of a model "
                         "without experts, which all stay in memory" + (": colibri run will refuse it"
                                                                        if mem_budget is not None else ""))
    disk_tok = ram_tok = 0.0
    for i in rest:
        ram_tok += sizes.active_bytes(i)
        if layers[i].tier == "disk":
            disk_tok += min(sizes.top_k, sizes.n_experts[i]) * (1 - layers[i].hit) * sizes.record_bytes[i]
    ram_tok += sizes.global_active
    budgeted = mem_budget is not None or cache > 0
    # (disk layers take the one call too while their experts are in the cache, a miss's layer the per-layer path;
    # GPU layers always the per-layer path)
    one_call = ONE_CALL_BW_SHARE.get(sizes.scheme, 0.0) if sizes.one_call and all(lp.tier != "gpu" for lp in layers) \
        else 0.0
    return PlanResult(layers, budget, gpu_budget, dense, gpu_bytes, cache, disk_tok, ram_tok, m.disk_bps,
                      m.ram_bps, notes, budgeted, ops_per_token(sizes), m.op_s, sizes.kv_bytes(ctx, slots),
                      one_call)


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


def auto_placement(container, mem_budget: int | None = None, gpu_budget: int | None = None,
                   usage: Usage | None = None, machine: Machine | None = None, ctx: int = DEFAULT_CTX,
                   slots: int = 1, kv_types=None) -> Placement:
    """The Placement for `container` on this machine (header and /proc/meminfo only, no weight read)."""
    sizes = PlanSizes.from_container(container, kv_types=kv_types)
    return plan(sizes, machine or current_machine(), mem_budget, gpu_budget, ctx, usage, slots).placement()


def placement_fn(container, ctx: int = DEFAULT_CTX, usage: Usage | None = None, machine: Machine | None = None,
                 slots: int = 1, kv_types=None):
    """A store PlacementFn `(sizes, mem_budget, gpu_budget) -> Placement` running the planner:
    what the Engine uses when no tier flags are given."""
    def place(_sizes: ModelSizes, mem_budget: int | None, gpu_budget: int | None) -> Placement:
        return auto_placement(container, mem_budget, gpu_budget, usage, machine, ctx, slots, kv_types)
    return place


def hot_set_placement(model_path: str | os.PathLike[str], usage_file: str | os.PathLike[str], ctx_size: int,
                      slots: int = 1, kv_types=None):
    """The planner's PlacementFn with the usage file's counts (hot experts pinned first), for an
    Engine run with `--usage-file` and no tier flags; plain planner until the file has counts."""
    from .format.container import Container

    with Container(model_path) as c:  # the planner needs only the parsed header, kept after close
        usage = Usage.load(usage_file, model_sizes(c).n_experts)
    return placement_fn(c, ctx_size, usage if usage.total_tokens() else None, slots=slots, kv_types=kv_types)


# ----------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 4 else f"{n / MiB:.1f} MiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def describe(r: PlanResult, sizes: PlanSizes) -> list[str]:
    out = [f"placement: {r.count('gpu')} layers on the GPU, {r.count('ram')} in RAM, {r.count('disk')} with "
           "experts read from disk"]
    if r.gpu_bytes:
        out.append(f"  GPU: layers 0..{r.count('gpu') - 1} ({_gib(r.gpu_bytes)} of {_gib(r.gpu_budget)})")
    what = "every weight" if not r.count("disk") else "dense parts of every layer, embeddings, lm_head"
    out.append(f"  kept in RAM: {_gib(r.resident)} of weights ({what})")
    disk = [lp for lp in r.layers if lp.tier == "disk"]
    if disk and r.cache_bytes:
        slots = sorted({lp.slots for lp in disk})
        s = f"{slots[0]}" if len(slots) == 1 else f"{slots[0]}..{slots[-1]}"
        hit = sum(lp.hit for lp in disk) / len(disk)
        out.append(f"  expert cache: {_gib(r.cache_bytes)} = {s} slots per disk layer "
                   f"(of {max(sizes.n_experts)} experts); expected hit rate {hit:.1%}")
    elif disk:
        out.append("  expert cache: none (disk layers read their top_k experts every token)")
    runs = "as one native call a step" if r.one_call else f"~{r.ops_per_token} torch operations"
    out.append(f"  each token reads {_gb(r.disk_per_token)} from disk and {_gb(r.ram_per_token)} of weights in "
               f"RAM, and runs {runs}")
    d, ram, ops = r.seconds_per_token
    cost = "step overhead" if r.one_call else "per-op cost"
    parts = f"disk {d * 1e3:.1f} ms + RAM {ram * 1e3:.1f} ms" + (f" + {cost} {ops * 1e3:.1f} ms" if ops else "")
    out.append(f"  expected decode speed: about {r.tok_s:,.1f} tok/s for one sequence ({parts} per token)")
    out += [f"  note: {n}" for n in r.notes]
    return out


def report(sizes: PlanSizes, m: Machine, mem_budget: int | None, gpu_budget: int | None, ctx: int,
           usage: Usage | None = None, top: int = 8, slots: int = 1) -> str:
    ours = plan(sizes, m, mem_budget, gpu_budget, ctx, usage, slots)
    moe = sizes.moe_layers
    eb = max(sizes.record_bytes) if moe else 0
    kv = ours.kv_bytes
    what = (f"{max(sizes.n_experts)} experts per layer in {len(moe)} layers, {sizes.top_k} used per token; in RAM "
            f"{_gib(sizes.total_bytes)} = dense {_gib(sizes.dense_bytes)} + experts "
            f"{_gib(sizes.total_bytes - sizes.dense_bytes)} ({eb / MiB:.2f} MiB each on disk)" if moe
            else f"dense (no expert); in RAM {_gib(sizes.total_bytes)}")
    lines = [
        f"model: {sizes.model_type} {sizes.scheme}, {sizes.n_layers} layers, {what}",
        f"machine: {_gib(m.mem_available)} of memory available{' (its memory cgroup limit)' if m.cgroup else ''}, GPU "
        + (f"{_gib(m.vram_free)} free" if m.vram_free is not None else "none")
        + f"; disk reads {m.disk_bps / 1e9:.2f} GB/s ({m.disk_note}); weights stream through matmuls at "
        f"{m.ram_bps / 1e9:.1f} GB/s ({m.ram_note})"
        + (f"; one torch op {m.op_s * 1e6:.1f} us" if m.op_s else ""),
        f"KV cache: {_gib(kv)} = {slots} slot{'s' if slots != 1 else ''} x {ctx} positions x "
        f"{sizes.kv_per_token / 1024:.1f} KiB ({sizes.kv_types} K/V)"
        + (f" + {_gib(sizes.kv_fixed)} of linear-attention state a slot" if sizes.kv_fixed else ""),
        f"memory for weights: {_gib(ours.weights_budget)} "
        + ("(--mem-budget)" if mem_budget is not None else
           f"(available memory - {_gib(headroom(m))} left {'to its page cache' if m.cgroup else 'to the system'} - "
           f"KV cache {_gib(kv)} - runtime "
           f"{_gib(RUNTIME_BYTES)})"),
        "",
    ]
    lines += describe(ours, sizes)
    weights = ours.resident + ours.cache_bytes
    lines.append(f"  RAM in total: about {_gib(weights + kv + RUNTIME_BYTES)} (weights {_gib(weights)} + KV cache "
                 f"{_gib(kv)} + runtime {_gib(RUNTIME_BYTES)})")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colibri plan", description="Print the placement colibri would use for "
                                "a model on this machine, and the speed to expect (reads only the header, "
                                "then probes the disk and the CPU for about a second).")
    p.add_argument("--model", "-m", required=True, help="path to a .coli container")
    p.add_argument("--mem-budget", help="RAM for weights (dense + expert cache), as for colibri run, e.g. "
                   "3G; default: available memory - 1 GiB - KV cache - runtime")
    p.add_argument("--gpu-budget", help="VRAM to use, e.g. 6G; default: free VRAM - 1 GiB")
    p.add_argument("--ctx-size", "-c", type=int, default=DEFAULT_CTX,
                   help="context length of each KV slot")
    p.add_argument("--slots", type=int, default=1,
                   help="sequences served at once (colibri serve --slots): each has a KV cache of --ctx-size")
    p.add_argument("--usage-file", help="routing counts recorded by `colibri run --usage-file`: "
                   "pin hot experts")
    from .cli.kvflags import add_cache_type_args

    add_cache_type_args(p)
    p.add_argument("--cluster", metavar="ADDRESS", help="print the layer split over the Ray cluster's nodes that "
                   "offer 'colibri' (HOST:PORT, or auto) and the speed to expect (docs/CLUSTER.md)")
    p.add_argument("--cluster-stages", type=int, default=None, metavar="N", help="use N of those nodes")
    p.add_argument("--mtp", action="store_true", help="plan with the model's multi-token-prediction layer loaded "
                   "(--spec mtp): its weights, kept in RAM, come out of --mem-budget")
    p.add_argument("--disk-speed", help="skip the read probe and assume this many bytes/s (e.g. 2G)")
    p.add_argument("--probe-seconds", type=float, default=0.5, help="length of the disk read probe")
    a = p.parse_args(argv)
    from .format.container import Container

    for flag, v in (("--ctx-size", a.ctx_size), ("--slots", a.slots)):
        if v < 1:
            raise ColibriError(f"{flag} must be at least 1, got {v}")
    if not math.isfinite(a.probe_seconds) or not 0 <= a.probe_seconds <= 60:
        raise ColibriError(f"--probe-seconds must be between 0 and 60, got {a.probe_seconds}")
    if not os.path.exists(a.model):
        raise ColibriError(f"model file {a.model} not found")
    mem = parse_size(a.mem_budget) if a.mem_budget else None
    gpu = parse_size(a.gpu_budget) if a.gpu_budget else None
    disk = float(parse_size(a.disk_speed)) if a.disk_speed else None
    if disk is not None and disk <= 0:
        raise ColibriError(f"--disk-speed must be above 0, got {a.disk_speed}")
    with Container(a.model) as c:
        sizes = PlanSizes.from_container(c, kv_types=(a.cache_type_k, a.cache_type_v))
        mtp = mtp_bytes(c)
    if a.mtp and not mtp:
        raise ColibriError(f"--mtp: {a.model} has no multi-token-prediction layer")
    if a.mtp and mem is not None:
        if mem <= mtp:
            raise ColibriError(f"--mtp: the MTP layer's weights ({_gib(mtp)}) take all of --mem-budget")
        mem -= mtp
    usage = None
    if a.usage_file:
        usage = Usage.load(a.usage_file, sizes.n_experts)
        if usage.total_tokens() == 0:
            print(f"colibri plan: {a.usage_file} has no recorded routing yet: planning for uniform routing",
                  file=sys.stderr)
            usage = None
    m = probe_machine(a.model, a.probe_seconds, max(max(sizes.record_bytes, default=0), 4096), sizes.scheme, disk)
    if a.cluster:
        from .cluster.report import cluster_report

        in_ram = sum(plan(sizes, m, 1 << 60, 0, a.ctx_size, usage, a.slots).seconds_per_token)
        with Container(a.model) as c:
            print(cluster_report(c, model_sizes(c), a.cluster, a.cluster_stages, mem, in_ram))
        return 0
    print(report(sizes, m, mem, gpu, a.ctx_size, usage, slots=a.slots))
    if mtp:
        print(f"MTP layer: {_gib(mtp)} in RAM " + ("beside the weights above (taken out of --mem-budget)" if a.mtp
                                                  else "more with --spec mtp (--mtp plans with it)"))
    return 0

