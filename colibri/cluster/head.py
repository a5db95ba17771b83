"""The head of a pipeline: the engine's scheduler, embedding, final norm, head and sampler stay here; the layers run
on stage actors, one per Ray node that offers the resource `colibri`, each a contiguous range of layers.

A step: the head embeds the rows, sends them through the stages in order (stage j's output ref goes straight into
stage j+1's call: Ray moves it), and runs the head on what comes back. With several sequences in the step, their
rows are cut into micro-batches (one per stage, whole sequences each) and every call is sent before any is
awaited: while stage 1 runs micro-batch 0, stage 0 runs micro-batch 1 (GPipe's schedule within one step). A step
of M micro-batches over S stages keeps each stage busy M of its M + S - 1 slots: the bubble is (S - 1) / (M + S - 1).
Rows are independent outside attention, and attention is per sequence: the cut changes no bit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine.kv import SlotPool
from ..engine.stats import StackedRoutes
from ..errors import ColibriError, StageLostError
from ..layers.batch import StepBatch
from ..store.sizes import model_sizes
from . import nodes, wire
from .split import layer_bytes, split

log = logging.getLogger("colibri")


@dataclass
class StageRef:
    actor: object
    node: dict
    name: str
    index: int
    lo: int = 0
    hi: int = 0
    threads: int = 1
    info: dict | None = None

    def __str__(self) -> str:
        return f"stage {self.index} on {self.name} (layers {self.lo}-{self.hi - 1})"


class StagedSlots(SlotPool):
    """The head's slots: token bookkeeping only (its caches are `Absent`); a prefix copied between slots is
    copied on every stage."""

    def __init__(self, *a, plan: StagedPlan, **kw):
        super().__init__(*a, **kw)
        self.plan = plan
        self.slot_of = {id(c): i for i, c in enumerate(self.caches)}
        self.rewindable = all(s.info["rewindable"] for s in plan.stages)

    @property
    def nbytes(self) -> int:  # (the K/V live on the stages: what they allocated)
        return sum(s.info["kv_bytes"] for s in self.plan.stages)

    def _copy(self, src: int, dst: int, start: int, end: int) -> None:
        self.plan.call_all("copy", src, dst, start, end)
        super()._copy(src, dst, start, end)

    def forget_all(self) -> None:
        for s in range(self.n_slots):
            self.forget(s)


class StagedPlan:
    """The DecodePlan of a model whose layers run on cluster stages (engine/decode_plan.py: the same calls)."""

    def __init__(self, model, stages: list[StageRef], opts: dict, deadline_s: float):
        self.model, self.stages, self.opts, self.deadline_s = model, stages, opts, deadline_s
        self.n_layers = len(model.model.layers)
        self.tail, self.micro = None, True  # (no native whole step here: engine/speculative.py reads `tail`)
        self._routes: dict = {}
        self.lost: str | None = None  # why the pipeline is down (a stage being restarted), None when whole
        self.steps = self.micro_batches = self.bytes_moved = 0
        self.idle = 0.0

    def describe(self) -> str:
        parts = "; ".join(f"{s.info['plan'].removeprefix('decode plan: ')} on {s.name}" for s in self.stages)
        return f"decode plan: cluster of {len(self.stages)} stages: {parts}"

    def rebuild(self, *a, **kw) -> None:
        pass

    def native_layers(self):
        return None

    def run_steps(self, *a, **kw):
        return None  # (no multi-step runs across stages: each token is one pass down the pipeline)

    def take_routes(self) -> dict:
        out, self._routes = self._routes, {}
        return out

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens)

    def head(self, h: torch.Tensor, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.logits(h if out_rows is None else h[out_rows])

    # ------------------------------------------------------------------ the step

    def step(self, tokens: torch.Tensor, batch: StepBatch, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.lost is not None:
            self.restore()
        h = self.layers(self.embed(tokens), batch, 0, self.n_layers)
        return self.head(h, out_rows)

    def layers(self, h: torch.Tensor, batch: StepBatch, lo: int, hi: int) -> torch.Tensor:
        if (lo, hi) != (0, self.n_layers):
            raise ValueError("a cluster's head runs the whole pipeline, not a range of it")
        slot_of = self.slot_of
        segs = [(s.r0, s.r1, s.start, slot_of[id(s.caches)]) for s in batch.seqs]
        groups = _micro_batches(segs, len(self.stages)) if self.micro else [segs]
        outs = []
        for g in groups:
            r0, r1 = g[0][0], g[-1][1]
            x = (wire.pack(h[r0:r1]), None)
            local = [(a - r0, b - r0, start, slot) for a, b, start, slot in g]
            for s in self.stages:  # (an actor call takes the ref of the one before: Ray hands the result over)
                x = s.actor.run.remote(x, local)
            outs.append(x)
        S, M = len(self.stages), len(groups)
        self.steps += 1
        self.micro_batches += M
        self.idle += (S - 1) / (M + S - 1)  # this step's bubble: each stage idle S - 1 of M + S - 1 turns
        got = nodes.wait(outs, [f"the pipeline ({', '.join(map(str, self.stages))})"] * M, self.deadline_s)
        # what crossed processes: the rows into each remote stage and back, the routes gathered on the way
        remote = sum(not isinstance(s.actor, nodes.LocalActor) for s in self.stages)
        self.bytes_moved += h.nbytes * (remote + (remote > 0)) + sum(r[1].nbytes + r[2].nbytes for _, r in got if r)
        self._routes = _merge([wire.unpack_routes(r) for _, r in got])
        rows = [wire.unpack(x, h.dtype) for x, _ in got]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    # ------------------------------------------------------------------ stages

    def call_all(self, method: str, *args, deadline_s: float | None = None) -> list:
        refs = [getattr(s.actor, method).remote(*args) for s in self.stages]
        return nodes.wait(refs, [str(s) for s in self.stages], deadline_s or self.deadline_s)

    def load(self) -> None:
        """Every stage loads its range (in parallel); their reports kept."""
        refs = [s.actor.load.remote(s.lo, s.hi, threads=s.threads, **self.opts) for s in self.stages]
        for s, info in zip(self.stages, nodes.wait(refs, [str(s) for s in self.stages], nodes.LOAD_S)):
            s.info = info

    def restore(self) -> None:
        """After a lost stage: wait for Ray to restart its actor and load its range again. Raises (the pipeline
        stays down) when it does not come back."""
        stats = nodes.until_up(lambda: self.call_all("stats", deadline_s=nodes.PING_S))
        todo = [s for s, st in zip(self.stages, stats) if tuple(st["layers"]) != (s.lo, s.hi)]
        refs = [s.actor.load.remote(s.lo, s.hi, threads=s.threads, **self.opts) for s in todo]
        nodes.wait(refs, [str(s) for s in todo], nodes.LOAD_S)
        log.warning("colibri: cluster whole again (%s reloaded)", ", ".join(map(str, todo)) or "no stage")
        self.lost = None

    def counters(self) -> dict:
        """For Engine.metrics: steps down the pipeline, micro-batches, bytes moved, the mean bubble."""
        return {"stages": len(self.stages), "steps": self.steps, "micro_batches": self.micro_batches,
                "bytes_moved": self.bytes_moved, "bubble": self.idle / self.steps if self.steps else 0.0,
                "layers": [(s.lo, s.hi) for s in self.stages], "nodes": [s.name for s in self.stages]}

    def n_experts(self) -> dict[int, int]:
        """MoE layer -> its routed experts (the runner's counters)."""
        return {k: v for s in self.stages for k, v in s.info["n_experts"].items()}

    def stage_stats(self) -> list[dict]:
        """Each stage's own figures (peak RSS, its store's counters): one call to every stage."""
        return self.call_all("stats")

    def health(self) -> dict:
        return {"cluster": "degraded" if self.lost else "ok", "stages": len(self.stages),
                **({"cluster_error": self.lost} if self.lost else {})}

    def close(self) -> None:
        try:
            nodes.wait([s.actor.close.remote() for s in self.stages], [str(s) for s in self.stages], nodes.PING_S)
        except ColibriError as e:
            log.warning("colibri: %s", e)
        nodes.kill([s.actor for s in self.stages])

    def failed(self, e: BaseException) -> bool:
        """A step raised: a lost stage takes the pipeline down until `restore`, and every slot's contents with it
        (that stage's K/V are gone: no prompt may reuse them); whether so (engine/decode_plan.py `failed`)."""
        if not isinstance(e, StageLostError):
            return False
        self.lost = str(e)
        self.slots.forget_all()
        return True


def open_cluster(engine, address: str, n_stages: int | None, mem_budget: int | None, opts: dict,
                 deadline_s: float | None) -> tuple[StagedSlots, StagedPlan]:
    """Join the cluster, start a stage on each node, split the layers by the nodes' budgets, load them; the head's
    slots and plan. `opts`: the stages' load options besides the range (ctx, slots, dtype, kv, prefetch, ...)."""
    picked, actors, facts, budgets = nodes.start_all(address, n_stages, engine.container, mem_budget)
    ranges = split(layer_bytes(model_sizes(engine.container, engine.dtype)), budgets)
    # a LocalActor runs in the engine thread, on the engine's threads (0: it sets none)
    stages = [StageRef(a, n, f["name"], j, lo, hi, 0 if isinstance(a, nodes.LocalActor) else
                       max(1, int(n.get("Resources", {}).get("CPU", 1))))
              for j, (a, n, f, (lo, hi)) in enumerate(zip(actors, picked, facts, ranges))]
    try:
        plan = StagedPlan(engine.model, stages, dict(opts, mem_budget=mem_budget), deadline_s or nodes.CALL_S)
        plan.load()
        slots = StagedSlots(engine.model, opts["slots"], opts["ctx"], engine.dtype, lambda i: torch.device("cpu"),
                            engine.kv_types, plan=plan)
        plan.slots, plan.slot_of = slots, slots.slot_of
        for s in stages:
            log.info("colibri: %s: %s; %s", s, s.info["placement"], s.info["plan"])
        return slots, plan
    except BaseException:
        nodes.kill(actors)
        raise


def _micro_batches(segs: list, n: int) -> list[list]:
    """The step's sequences cut into at most n groups of whole sequences, rows as even as the cut allows."""
    if n < 2 or len(segs) < 2:
        return [segs]
    n = min(n, len(segs))
    total, groups, cur = segs[-1][1], [], []
    for i, seg in enumerate(segs):
        cur.append(seg)
        left_groups = n - len(groups) - 1
        if left_groups and (seg[1] >= total * (len(groups) + 1) / n or len(segs) - i - 1 == left_groups):
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


def _merge(parts: list[Mapping]) -> Mapping:
    """Routes of every micro-batch's pass -> one step's routes: per layer, rows in the step's order."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, StackedRoutes) and p.layers == parts[0].layers for p in parts):
        cat = [torch.cat([getattr(p, a) for p in parts], 1) for a in ("idx", "wts")]  # rows: dim 1 of [L, R, k]
        return StackedRoutes(parts[0].layers, *cat)
    by_layer: dict[int, list] = {}
    for routes in parts:  # micro-batch-major: a layer's parts come in row order
        for layer, r in routes.items():
            by_layer.setdefault(layer, []).append(r)
    return {layer: rs[0] if len(rs) == 1 else (torch.cat([r[0] for r in rs]), torch.cat([r[1] for r in rs]))
            for layer, rs in by_layer.items()}
