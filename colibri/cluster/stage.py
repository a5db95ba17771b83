"""One pipeline stage: a contiguous range of a model's layers, their weights under this node's own budget, and
their part of every KV slot. A plain class (the Ray actor in cluster/nodes.py wraps it): `facts` before the head
splits the layers, `load` once, then `run` per step.

The stage runs its range through the same decode plan a single node runs (engine/decode_plan.py `layers`), so a
layer computes the same bits wherever it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import numpy as np
import torch

from ..analysis.probe import mem_available
from ..errors import ColibriError
from ..format.container import Container
from ..kernels import native
from ..layers.batch import Seq, StepBatch
from ..layers.kvquant import KVTypes
from ..layers.moe import SwitchGLU
from ..models.base import bind, build
from ..store import TieredStore
from ..store.placement import parse_size
from ..store.sizes import model_sizes
from . import wire
from .elsewhere import hold
from .split import stage_placement

Segs = list[tuple[int, int, int, int]]  # per sequence of a step: rows [r0, r1), first position, slot


def container_id(c: Container) -> str:
    """The container's identity: a hash of its header (tensor offsets, shapes and every record's checksum)."""
    return hashlib.sha256(json.dumps(c.header, sort_keys=True, default=str).encode()).hexdigest()[:16]


def node_budget(given: int | None) -> int | None:
    """This node's bytes for weights: COLIBRI_STAGE_BUDGET from the environment `ray start` ran in (a node-local
    override), else the head's --mem-budget."""
    own = os.environ.get("COLIBRI_STAGE_BUDGET")
    return parse_size(own) if own else given


class Stage:
    """Layers [lo, hi) of the container at `path` (COLIBRI_MODEL in the node's environment overrides it: nodes
    that keep the file at another path)."""

    def __init__(self, path: str):
        self.path = os.environ.get("COLIBRI_MODEL") or path
        self.name = f"{socket.gethostname()} ({os.environ.get('RAY_NODE_IP_ADDRESS') or _ip()})"
        self.store = None
        self.range = (0, 0)
        self.busy_s, self.calls = 0.0, 0  # time in `run` (the rest of a step is transport and the head)

    def facts(self, mem_budget: int | None) -> dict:
        """What the head needs to split the layers: the container's identity, this node's budget and memory."""
        if not os.path.exists(self.path):
            raise ColibriError(f"node {self.name}: no model at {self.path} (set COLIBRI_MODEL in the environment "
                               "`ray start` runs in where the path differs)")
        with Container(self.path) as c:
            ident = container_id(c)
        avail, capped = mem_available()
        return {"name": self.name, "path": self.path, "id": ident, "budget": node_budget(mem_budget),
                "available": avail, "capped": capped, "cores": os.cpu_count() or 1}

    def load(self, lo: int, hi: int, *, ctx: int, slots: int, dtype: str, kv: tuple[str, str],
             mem_budget: int | None, threads: int, prefetch: bool = True, direct_io: bool = True,
             cache_policy: str = "reuse") -> dict:
        """Bind layers [lo, hi) and allocate their slots; what the head reports about this stage."""
        from ..engine.decode_plan import DecodePlan
        from ..engine.kv import SlotPool

        torch.set_num_threads(1)
        self.container = c = Container(self.path)
        self.dtype = getattr(torch, dtype)
        self.model, _ = build(c.model_type, c.config)
        keep = hold(self.model, lo, hi, ends=False)
        budget = node_budget(mem_budget)
        place = stage_placement(model_sizes(c, self.dtype), lo, hi, budget)
        self.store = TieredStore(c, self.dtype, place, mem_budget=budget, prefetch=prefetch, direct_io=direct_io,
                                 policy=cache_policy, keep=keep)
        bind(self.model, self.store)
        self.store.attach(self.model)
        self.model.model.embed_tokens.out_dtype = self.dtype
        self.model.eval()
        self.slots = SlotPool(self.model, slots, ctx, self.dtype, self.store.layer_device, KVTypes.of(kv))
        self.plan = DecodePlan(self.model, held=(lo, hi))
        self.range, self.threads = (lo, hi), threads
        self._threads_now = (0, 0)
        tiers = place.tiers[lo:hi]
        where = ", ".join(f"{tiers.count(t)} {w}" for t, w in (("ram", "in RAM"), ("disk", "streamed from disk"))
                          if tiers.count(t))
        return {"name": self.name, "layers": (lo, hi), "plan": self.plan.describe(), "placement": where,
                "rewindable": self.slots.rewindable, "kv_bytes": self.slots.nbytes,
                "resident": self.store.resident_bytes(), "peak_rss": _peak_rss(),
                "n_experts": {m.layer: m.num_experts for m in self.model.modules() if isinstance(m, SwitchGLU)}}

    def run(self, x: tuple[np.ndarray, wire.Packed | None], segs: Segs) -> tuple[np.ndarray, wire.Packed | None]:
        """The stage's layers over a step's hidden states: x = (rows [T, H] `wire.pack`ed, the routes of the stages
        before, `wire.pack_routes`d) -> (the rows out, those routes and this stage's).
        One object in, one out: the next stage's call takes this one's result as it is."""
        t0 = time.perf_counter()
        h = wire.unpack(x[0], self.dtype)
        self._threads(h.shape[0] <= native.MOE_MAX_ROWS)
        caches = self.slots.caches
        batch = StepBatch([Seq(r0, r1, start, caches[slot]) for r0, r1, start, slot in segs])
        with torch.inference_mode():
            out = wire.pack(self.plan.layers(h, batch, *self.range))
            routes = wire.pack_routes(self.plan.take_routes(), x[1])
        self.busy_s += time.perf_counter() - t0
        self.calls += 1
        return out, routes

    def _threads(self, small: bool) -> None:
        # as the single-node runner (engine/runner.py _set_threads): decode rows on the native pool, prefill on torch
        if not self.threads:  # (a stage in the head's process: the engine thread's counts)
            return
        want = (1, self.threads) if small and native.available() else (self.threads, 1)
        if want != self._threads_now:
            torch.set_num_threads(want[0])
            native.set_threads(want[1])
            self._threads_now = want

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Positions start..end of slot src's caches into slot dst (a shared prompt prefix, engine/kv.py)."""
        self.slots._copy(src, dst, start, end)

    def stats(self) -> dict:
        s = self.store.stats() if self.store is not None else {}
        return {"name": self.name, "layers": self.range, "peak_rss": _peak_rss(), "store": s, "busy_s": self.busy_s,
                "calls": self.calls}

    def ping(self) -> str:
        return self.name

    def echo(self, x):
        """`x` back, untouched: the transport's own round trip (benchmarks/bench_cluster.py)."""
        return x

    def close(self) -> None:
        if self.store is not None:
            native.background_wait()
            self.store.close()
            self.container.close()
            self.store = None


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return 0


def _ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - a name for messages only
        return "?"
