"""What a container's parts cost in memory once loaded, and the store's simple placement rule.

Header only: nothing here reads a weight. The planner (colibri/plan.py) builds on `ModelSizes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..container import DTYPES, Container
from ..models.base import layer_of
from ..quant import FUSED_MAX_ROWS, _int4_cpu_fusable
from .placement import Placement
from .reader import round_up

EXTRA_ALIGN = 64  # alignment of module buffers moved into a cache slot's tail


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


DTYPES_ITEMSIZE = {dt: torch.empty(0, dtype=dt).element_size() for dt in DTYPES.values()}


def qlinear_extra_bytes(info: dict, compute_dtype: torch.dtype, device_type: str = "cpu") -> int:
    """Bytes a QLinear over this stored weight allocates beyond the stored tensors (its `nbytes`).

    Mirrors QLinear.from_tensors: dtype casts of float weights, the int8 scale cast, and the
    int4 repack for the fused CPU kernel. tests/test_tiers.py checks it against QLinear.nbytes.
    """
    isz = torch.empty(0, dtype=compute_dtype).element_size()
    q = info.get("quant")
    if q is None:
        # Float linears are cast to the compute dtype; f32 tensors are parameters (norms,
        # routers), which keep their dtype, as do embeddings.
        dt = DTYPES[info["dtype"]]
        return 0 if dt in (compute_dtype, torch.float32) else info["nbytes"] // DTYPES_ITEMSIZE[dt] * isz
    out, n_in = q["shape"]
    if q["scheme"] == "int8":
        return 0 if compute_dtype == torch.float32 else out * isz
    if (q["scheme"] == "int4" and device_type == "cpu" and FUSED_MAX_ROWS.get(("int4", compute_dtype), 0) > 0
            and _int4_cpu_fusable((out, n_in), q["group_size"], compute_dtype)):
        return out * n_in // 2 + (n_in // q["group_size"]) * out * 2 * isz
    return 0


@dataclass
class ModelSizes:
    """What each part of a container costs in memory once loaded (bytes; from the header only).

    Dense tensors and expert records are counted rounded up to 4096 (their buffers are
    page-aligned for O_DIRECT), plus the modules' own allocations (qlinear_extra_bytes).
    """

    n_layers: int
    top_k: int
    global_dense_bytes: int  # embeddings, final norm, lm_head
    layer_dense_bytes: list[int]  # attention, norms, router, shared experts / dense MLP
    n_experts: list[int]  # routed experts per layer (0 for a dense layer)
    expert_bytes: list[int]  # one routed expert held in RAM: a cache slot (record + module buffers)
    record_bytes: list[int]  # one routed expert as read from disk
    gpu_expert_bytes: list[int] = field(default_factory=list)  # one routed expert held on a GPU

    @property
    def dense_bytes(self) -> int:
        return self.global_dense_bytes + sum(self.layer_dense_bytes)

    def layer_experts_bytes(self, layer: int) -> int:
        return self.n_experts[layer] * self.expert_bytes[layer]

    @property
    def total_bytes(self) -> int:
        """Everything resident in RAM (no disk tier)."""
        return self.dense_bytes + sum(self.layer_experts_bytes(i) for i in range(self.n_layers))

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.n_experts[i]]


def model_sizes(c: Container, compute_dtype: torch.dtype | None = None) -> ModelSizes:
    """Memory costs of a container's parts, for planning (no weight is read)."""
    if compute_dtype is None:
        compute_dtype = torch.float32 if c.quant.get("scheme") == "f32" else torch.bfloat16
    tensors = c.header["tensors"]
    layers = [layer_of(n) for n in tensors] + [layer_of(n) for n in c.header["records"]]
    n_layers = 1 + max((i for i in layers if i is not None), default=-1)
    glob, per_layer = 0, [0] * n_layers
    for name, e in tensors.items():
        if "record" in e:
            continue
        linear = name.endswith(".weight") and "embed" not in name
        nb = round_up(e["nbytes"]) + (qlinear_extra_bytes(e, compute_dtype) if linear else 0)
        if name.endswith(".bias") and DTYPES[e["dtype"]] != compute_dtype:
            w = tensors.get(name.removesuffix(".bias") + ".weight")
            if w is not None and ("quant" in w or w["dtype"] != "f32"):  # a linear's bias: cast
                nb += e["nbytes"] // DTYPES_ITEMSIZE[DTYPES[e["dtype"]]] * DTYPES_ITEMSIZE[compute_dtype]
        i = layer_of(name)
        if i is None:
            glob += nb
        else:
            per_layer[i] += nb
    n_exp, rec, exp_ram, exp_gpu = [0] * n_layers, [0] * n_layers, [0] * n_layers, [0] * n_layers
    for rname, r in c.header["records"].items():
        i = layer_of(rname)
        if i is None:
            continue
        n_exp[i] += 1
        if rec[i]:
            continue
        rec[i] = r["nbytes"]
        members = [tensors[full] for sub, full in r["tensors"].items() if sub.endswith(".weight")]
        exp_ram[i] = slot_bytes(r["nbytes"], [qlinear_extra_bytes(m, compute_dtype) for m in members])
        exp_gpu[i] = slot_bytes(r["nbytes"], [qlinear_extra_bytes(m, compute_dtype, "cuda") for m in members])
    top_k = int(c.config.get("num_experts_per_tok") or 1)
    return ModelSizes(n_layers, top_k, glob, per_layer, n_exp, exp_ram, rec, exp_gpu)


def slot_bytes(record_nbytes: int, extras: list[int]) -> int:
    """Bytes of one expert-cache slot: the record (rounded for O_DIRECT) then the modules' own
    buffers (each 64-aligned), so every byte of a cached expert lives in the cache's arena."""
    tail = sum(round_up(x, EXTRA_ALIGN) for x in extras if x)
    return round_up(record_nbytes) + (round_up(tail) if tail else 0)


def default_placement(sizes: ModelSizes, mem_budget: int | None) -> Placement:
    """Everything in RAM, unless `mem_budget` is smaller than the model: then the routed experts
    of the last MoE layers go to the disk tier, as few layers as leave the expert cache room for
    top_k experts of each disk layer (or, failing that, all MoE layers on disk)."""
    n = sizes.n_layers
    if mem_budget is None or sizes.total_bytes <= mem_budget:
        return Placement(["ram"] * n, mem_budget=mem_budget)
    moe = sizes.moe_layers
    slot = max((sizes.expert_bytes[i] for i in moe), default=0)
    for k in range(1, len(moe) + 1):
        disk = set(moe[-k:])
        resident = sizes.dense_bytes + sum(sizes.layer_experts_bytes(i) for i in moe if i not in disk)
        if mem_budget - resident >= k * sizes.top_k * slot or k == len(moe):
            tiers = ["disk" if i in disk else "ram" for i in range(n)]
            return Placement(tiers, mem_budget=mem_budget)
    return Placement(["ram"] * n, mem_budget=mem_budget)  # no MoE layer at all
