"""What a container's parts cost in memory once loaded (header only: nothing here reads a weight).

The store sizes its arenas and caches with it; the planner (colibri/plan.py) builds on `ModelSizes`,
so a plan's budget is exactly what the store will hold. A quantized linear's own allocations
come from quant.owned_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.container import Container
from ..layers.mtp import PREFIX as MTP
from ..layers.mtp import View, present
from ..models.base import layer_of
from ..quant import OWNED_ALIGN, bias_bytes, owned_bytes
from .reader import round_up


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass
class ModelSizes:
    """What each part of a container costs in memory once loaded (bytes; from the header only).

    Dense tensors and expert records are counted rounded up to 4096 (their buffers are
    page-aligned for O_DIRECT), plus the modules' own allocations (quant.owned_bytes).
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
    # (a container's MTP layers are planned as their own model: engine/mtp.py)
    tensors = {n: e for n, e in c.header["tensors"].items() if not n.startswith(MTP)}
    layers = [layer_of(n) for n in tensors] + [layer_of(n) for n in c.header["records"]]
    n_layers = 1 + max((i for i in layers if i is not None), default=-1)
    glob, per_layer = 0, [0] * n_layers
    for name, e in tensors.items():
        if "record" in e:
            continue
        linear = name.endswith(".weight") and "embed" not in name
        nb = round_up(e["nbytes"]) + (owned_bytes(e, compute_dtype) if linear else 0)
        if name.endswith(".bias"):
            w = tensors.get(name.removesuffix(".bias") + ".weight")
            if w is not None and ("quant" in w or w["dtype"] != "f32"):  # a linear's bias (f32: a parameter's)
                nb += bias_bytes(e, compute_dtype)
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
        biases = [bias_bytes(tensors[full], compute_dtype) for sub, full in r["tensors"].items()
                  if sub.endswith(".bias")]
        exp_ram[i] = slot_bytes(r["nbytes"], [owned_bytes(m, compute_dtype) for m in members] + biases)
        exp_gpu[i] = slot_bytes(r["nbytes"], [owned_bytes(m, compute_dtype, "cuda") for m in members] + biases)
    top_k = int(c.config.get("num_experts_per_tok") or 1)
    return ModelSizes(n_layers, top_k, glob, per_layer, n_exp, exp_ram, rec, exp_gpu)


def mtp_bytes(c: Container) -> int:
    """Bytes of the container's first multi-token-prediction layer (engine/mtp.py keeps it in RAM, beside the
    model's weights), 0 where it has none."""
    if not present(c.header):
        return 0
    return model_sizes(View(c)).total_bytes  # type: ignore[arg-type]


def slot_bytes(record_nbytes: int, extras: list[int]) -> int:
    """Bytes of one expert-cache slot: the record (rounded for O_DIRECT) then the modules' own
    buffers (each 64-aligned), so every byte of a cached expert lives in the cache's arena."""
    tail = sum(round_up(x, OWNED_ALIGN) for x in extras if x)
    return round_up(record_nbytes) + (round_up(tail) if tail else 0)
