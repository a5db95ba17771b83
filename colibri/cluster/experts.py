"""Expert workers (`--cluster-mode experts`): the head keeps attention, the dense layers and the K/V; the routed
experts live on the nodes that offer `colibri`, each expert always on the same one (a layer's experts cut into
contiguous shares in proportion to the nodes' budgets).

Per MoE layer and step, the head sends the step's rows and routes once to every worker that owns one of the
experts they need (every call sent before any reply is read); each worker computes the slots routed to its
experts, exactly as a single machine's layer would (layers/moe.py: the native kernel's per-slot outputs, or the
modules one expert at a time), and the head sums the slots in the single machine's fixed order. The bits are the
single machine's.
"""

from __future__ import annotations

import numpy as np
import torch

from ..arena import aligned_buffer
from ..errors import ColibriError, StageLostError
from ..format.container import Container
from ..kernels import native
from ..layers.moe import SwitchGLU, native_expert
from ..models.base import build
from ..store.loader import RecordLoader
from ..store.reader import IO_THREADS, RecordReader
from ..store.sizes import model_sizes
from . import nodes, wire
from .split import split
from .stage import Stage, _peak_rss


def owners(n_experts: int, budgets: list[int]) -> list[tuple[int, int]]:
    """A layer's experts cut into one contiguous share per worker, in proportion to their budgets."""
    if n_experts < len(budgets):
        return split([1] * n_experts, budgets[:n_experts]) + [(n_experts, n_experts)] * (len(budgets) - n_experts)
    return split([1] * n_experts, budgets)


class ExpertWorker(Stage):
    """A node's share of every MoE layer's routed experts (the Ray actor's body; `facts` as a stage's)."""

    def load_experts(self, shares: dict[int, tuple[int, int]], dtype: str, threads: int) -> dict:
        """Read experts [a, b) of each layer in `shares` (layer -> (a, b)) into memory this worker owns."""
        self.dtype = getattr(torch, dtype)
        self.container = c = Container(self.path)
        model, _ = build(c.model_type, c.config)
        self.mods = {m.layer: m for m in model.modules() if isinstance(m, SwitchGLU) and m.layer in shares}
        prefixes = {m.layer: name for name, m in model.named_modules()
                    if isinstance(m, SwitchGLU) and m.layer in shares}
        self.reader = RecordReader(c.path, IO_THREADS, True)
        loader = RecordLoader(c, self.reader, self.dtype, prefixes)
        sizes = model_sizes(c, self.dtype)
        jobs = [(layer, e) for layer, (a, b) in shares.items() for e in range(a, b)]
        arena = aligned_buffer(max(sum(sizes.expert_bytes[layer] for layer, _ in jobs), 1))
        futs, pos = [], 0
        for layer, e in jobs:
            span = sizes.expert_bytes[layer]
            futs.append(self.reader.submit(loader.load, layer, e, arena[pos:pos + span]))
            pos += span
        self.experts = {job: f.result() for job, f in zip(jobs, futs)}
        self.arena, self.threads, self._threads_now = arena, threads, (0, 0)
        self.range = (0, len(jobs))
        return {"name": self.name, "experts": len(jobs), "bytes": pos, "peak_rss": _peak_rss()}

    def outputs(self, layer: int, x: np.ndarray, idx: np.ndarray, weights: np.ndarray) -> tuple:
        """This worker's slots of one MoE layer's step: (the slot numbers [n], their outputs [n, H] packed, whether
        the native kernel made them)."""
        self._threads(True)
        mod = self.mods[layer]
        x, idx, w = wire.unpack(x, self.dtype), torch.from_numpy(np.array(idx)), torch.from_numpy(np.array(weights))
        T, k = idx.shape
        mine = [e for e in torch.unique(idx).tolist() if (layer, e) in self.experts]
        sel = torch.isin(idx.reshape(-1), torch.tensor(mine, dtype=torch.int64)).nonzero().reshape(-1)
        with torch.inference_mode():
            if uses_native(mod, x) and all(native_expert(self.experts[layer, e]) for e in mine):
                tables = native.MoeTables(mod.num_experts, mod.native_act, mod.input_scaled)
                for e in mine:
                    ew = self.experts[layer, e]
                    tables.set(e, ew.gate_up, ew.down)
                first = self.experts[layer, mine[0]].gate_up
                ys = torch.zeros(T * k, mod.hidden, dtype=torch.float32)
                native.moe(tables, x.contiguous(), idx.contiguous(), w.float().contiguous(), mod.intermediate,
                           first.scheme, first.group_size, ys, combine=False)
                return sel.numpy(), ys[sel].numpy(), (first.scheme, first.group_size)
            ys = mod.slot_outputs(x, idx, [(e, self.experts[layer, e]) for e in mine])  # (the layer's own code)
            return sel.numpy(), wire.pack(ys[sel]), None

    def close(self) -> None:
        if getattr(self, "reader", None) is not None:
            self.reader.close()
            self.container.close()
            self.reader = None


def uses_native(mod: SwitchGLU, x: torch.Tensor) -> bool:
    """Whether a single machine's layer would take the native kernel for these rows (layers/moe.py forward)."""
    return (mod.native_act is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.shape[0] <= native.MOE_MAX_ROWS and native.available())


class RemoteExperts:
    """The head's expert source in experts mode: `SwitchGLU.forward` hands it the layer's rows (`remote`)."""

    remote = True

    def __init__(self, workers: list, names: list[str], shares: dict[int, list[tuple[int, int]]], deadline_s: float):
        self.workers, self.names, self.shares, self.deadline_s = workers, names, shares, deadline_s
        self._tables: dict[int, native.MoeTables] = {}
        self.calls = self.bytes_moved = 0
        self.lost: str | None = None
        self.loads: list[tuple] = []  # each worker's load_experts arguments (a restarted one gets them again)

    def holds_all(self, layer: int) -> bool:
        return False

    def n_experts(self) -> dict[int, int]:
        return {layer: sh[-1][1] for layer, sh in self.shares.items()}

    def counters(self) -> dict:
        return {"mode": "experts", "workers": len(self.workers), "calls": self.calls, "bytes_moved": self.bytes_moved,
                "nodes": self.names}

    def health(self) -> dict:
        return {"cluster": "degraded" if self.lost else "ok", "workers": len(self.workers),
                **({"cluster_error": self.lost} if self.lost else {})}

    def worker_stats(self) -> list[dict]:
        return nodes.wait([w.stats.remote() for w in self.workers], self.names, nodes.PING_S)

    def close(self) -> None:
        try:
            nodes.wait([w.close.remote() for w in self.workers], self.names, nodes.PING_S)
        except ColibriError:
            pass
        nodes.kill(self.workers)

    def restore(self) -> None:
        """After a lost worker: wait for Ray to restart it and give it its experts again."""
        stats = nodes.until_up(self.worker_stats)
        todo = [j for j, st in enumerate(stats) if tuple(st["layers"]) == (0, 0)]  # (a fresh process)
        refs = [self.workers[j].load_experts.remote(*self.loads[j]) for j in todo]
        nodes.wait(refs, [self.names[j] for j in todo], nodes.LOAD_S)
        self.lost = None

    def run(self, mod: SwitchGLU, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.lost:
            self.restore()
        try:
            return self._run(mod, x, idx, weights)
        except StageLostError as e:
            self.lost = str(e)
            raise

    def _run(self, mod: SwitchGLU, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        T, k = idx.shape
        need = set(torch.unique(idx).tolist())
        who = [j for j, (a, b) in enumerate(self.shares[mod.layer]) if any(a <= e < b for e in need)]
        xs, ids, ws = wire.pack(x), idx.contiguous().numpy(), weights.float().contiguous().numpy()
        refs = [self.workers[j].outputs.remote(mod.layer, xs, ids, ws) for j in who]  # all sent, then read
        got = nodes.wait(refs, [self.names[j] for j in who], self.deadline_s)
        self.calls += len(who)
        self.bytes_moved += len(who) * (xs.nbytes + ids.nbytes + ws.nbytes) + sum(s.nbytes + y.nbytes
                                                                                  for s, y, _ in got)
        quant = next((q for _, _, q in got if q is not None), None)
        if quant is not None:  # the native kernel's slots, summed by the kernel as a single machine's layer does
            ys = torch.zeros(T * k, mod.hidden, dtype=torch.float32)
            for s, y, _ in got:
                ys[torch.from_numpy(np.array(s))] = torch.from_numpy(np.array(y))
            tables = self._tables.get(mod.layer)
            if tables is None:
                tables = self._tables[mod.layer] = native.MoeTables(mod.num_experts, mod.native_act, mod.input_scaled)
            return native.moe(tables, x.contiguous(), idx.contiguous(), weights.float().contiguous(),
                              mod.intermediate, quant[0], quant[1], ys)
        ys = x.new_empty(T * k, mod.hidden)  # (every slot is some worker's)
        for s, y, _ in got:
            ys[torch.from_numpy(np.array(s))] = wire.unpack(y, x.dtype)
        return mod.combine(ys, weights, x.dtype)


def open_experts(engine, address: str, n_workers: int | None, mem_budget: int | None, deadline_s: float | None):
    """Join the cluster, start a worker on each node offering `colibri`, give each its share of every MoE layer's
    experts, and bind the head's MoE layers to them; the remote source (for metrics and close)."""
    picked, workers, facts, budgets = nodes.start_all(address, n_workers, engine.container, mem_budget, ExpertWorker)
    try:
        names = [f"expert worker {j} on {f['name']}" for j, f in enumerate(facts)]
        mods = [m for m in engine.model.modules() if isinstance(m, SwitchGLU)]
        shares = {m.layer: owners(m.num_experts, budgets) for m in mods}
        threads = [0 if isinstance(w, nodes.LocalActor) else max(1, int(n.get("Resources", {}).get("CPU", 1)))
                   for w, n in zip(workers, picked)]
        loads = [({layer: sh[j] for layer, sh in shares.items()}, str(engine.dtype).removeprefix("torch."), t)
                 for j, t in enumerate(threads)]
        infos = nodes.wait([w.load_experts.remote(*a) for w, a in zip(workers, loads)], names, nodes.LOAD_S)
        source = RemoteExperts(workers, names, shares, deadline_s or nodes.CALL_S)
        source.infos, source.loads = infos, loads
        for m in mods:
            m.source = source
        return source
    except BaseException:
        nodes.kill(workers)
        raise
