"""Routed experts over stacked per-expert weights, fed by an expert source from the store.

The source decides where expert weights live (resident, cached from disk, GPU); this
module only says which experts it needs and combines their outputs in a fixed order,
so the result is bit-identical whatever order the source delivers them in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from ..quant import QLinear
from . import native_mlp
from .norms import out_norm_ptr


@dataclass
class ExpertWeights:
    gate_up: nn.Module  # [H] -> [2I] (gate rows, then up rows)
    down: nn.Module  # [I] -> [H]


class ExpertSource(Protocol):
    """Where a model's routed experts come from (the store's `Experts`): one object for all layers."""

    def fetch(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """(expert id, weights) once per id, in any order; weights stay valid until the next step.
        Reads of experts not in memory have started when it returns."""
        ...

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """A hint that these experts of `layer` are needed soon (may be a no-op)."""
        ...

    def holds_all(self, layer: int) -> bool:
        """Whether every expert of `layer` stays in memory through a step (no cache slots to recycle),
        so the layer may hold all its fetched experts at once (the one-call native path)."""
        ...

    def look_ahead(self, layer: int, resid: torch.Tensor) -> None:
        """`layer` has claimed its experts: start reading what the next routed layers will likely need, predicted
        from the residual resid [T, H] (may be a no-op)."""
        ...

    def native_tables(self, experts: SwitchGLU) -> native.MoeTables | None:
        """The native kernels' expert tables of a layer: every expert of a resident layer (filled once), or the
        experts in memory of a cached one (kept so by its cache, for the native call's streamed layers); None
        where its experts are not int8/int4 native weights of one scheme."""
        ...

    def collect_landed(self, layers: list[int]) -> None:
        """Before a native call over these cached layers: take in the reads that have landed, so that their
        tables list them."""
        ...


def silu_glu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def relu2(h: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's ungated experts: relu(up)^2 of the up rows alone."""
    return F.relu(h).square()


class SwitchGLU(nn.Module):
    """The routed experts of one layer: `forward(x [T, H], idx [T, k], weights [T, k]) -> [T, H]`."""

    def __init__(self, layer: int, hidden: int, intermediate: int, num_experts: int,
                 act: Callable[[torch.Tensor], torch.Tensor] = silu_glu,
                 native_act: tuple[int, float, float] | None = None, gated: bool = True):
        super().__init__()
        # gate_up's rows: [gate; up] ([2I, H]), or up alone ([I, H]) for an ungated activation (Nemotron-H's)
        self.gated = gated
        self.layer, self.hidden, self.intermediate, self.num_experts = layer, hidden, intermediate, num_experts
        self.act = act
        # The native kernels' form of `act` (kernels/native.py ACT_*: kind, alpha, limit); None: torch's only
        self.native_act = (native.ACT_SILU, 0.0, 0.0) if act is silu_glu else native_act
        self.source: ExpertSource | None = None  # bound by the store
        # This step's routes (idx [T, k], weights [T, k]), a value the decode plan reads and clears after the step
        # (stats, the routing log, traces); the layer never calls out with them.
        self.route: tuple[torch.Tensor, torch.Tensor] | None = None
        # The routing weights scaled x already (Llama 4): they go to `route`, the outputs are summed as they are
        self.input_scaled = False
        self._tables: native.MoeTables | None = None  # the native kernel's expert pointers (built on first use)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                resid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] normed rows, idx/weights [T, k] their routes, resid [T, H] the residual the
        look-ahead predicts the next layer's routes from -> [T, H]."""
        T, k = idx.shape
        self.route = (idx, weights)
        if self.input_scaled:
            weights = torch.ones_like(weights, dtype=torch.float32)
        if getattr(self.source, "remote", False):  # experts on other machines (colibri/cluster/experts.py)
            return self.source.run(self, x, idx, weights)
        if self.native_act is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) \
                and T <= native.MOE_MAX_ROWS and native.available():
            ids = routed_ids(idx)
            fetched = self.source.fetch(self.layer, ids)
            self._look_ahead(resid)
            return self._native(x, idx, weights, fetched)
        return self._experts(x, idx, weights, None, resid)

    def _native(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                fetched: Iterator[tuple[int, ExpertWeights]]) -> torch.Tensor:
        """The layer through the native kernel (colibri/kernels) when its experts are native int8/int4
        QLinears of one scheme (all experts of a layer are built alike, so the first decides): one call
        when the source holds the whole layer, else one per expert as the cache hands them over (each
        is valid only until the next), then the weighted sum. Numerics are the same either way."""
        first = next(fetched, None)
        if first is None or not native_expert(first[1]):
            return self._experts(x, idx, weights, itertools.chain([first] if first else [], fetched))
        m = first[1].gate_up
        if self._tables is None:
            self._tables = native.MoeTables(self.num_experts, self.native_act, self.input_scaled)
        tables, resident = self._tables, self.source.holds_all(self.layer)
        x, idx, weights = x.contiguous(), idx.contiguous(), weights.float().contiguous()
        ys = torch.empty(idx.numel(), self.hidden, dtype=torch.float32)  # [T*k, H] each slot's expert output
        args = (x, idx, weights, self.intermediate, m.scheme, m.group_size, ys)
        for e, w in itertools.chain([first], fetched):
            if not native_expert(w, m):
                raise RuntimeError(f"layer {self.layer}: expert {e} is not built like expert {first[0]}")
            tables.set(e, w.gate_up, w.down)
            if not resident:
                try:
                    native.moe(tables, *args, combine=False)
                finally:
                    tables.clear(e)
        return native.moe(tables, *args)  # (a cached layer's entries are cleared: only the weighted sum)

    def _experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                 fetched: Iterable[tuple[int, ExpertWeights]] | None, resid: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The experts one module call at a time (any activation, scheme or device); `fetched`: the
        layer's fetch when the caller began it (then it also ran the look-ahead)."""
        return self.combine(self.slot_outputs(x, idx, fetched, resid), weights, x.dtype)

    def slot_outputs(self, x: torch.Tensor, idx: torch.Tensor, fetched: Iterable[tuple[int, ExpertWeights]] | None,
                     resid: torch.Tensor | None = None) -> torch.Tensor:
        """ys [T*k, H]: each (row, slot)'s expert output, for the slots whose expert `fetched` hands over (all of
        them when None: the layer's own fetch); the rest left unset (cluster expert workers compute their share)."""
        T, k = idx.shape
        ys = x.new_empty(T * k, self.hidden)  # one output row per (token, slot)
        if T == 1:
            slots: dict[int, list[int]] = {}  # expert -> its slots (two where a route repeats one: LongCat's)
            for j, e in enumerate(idx[0].tolist()):
                slots.setdefault(e, []).append(j)
            if fetched is None:
                fetched = self.source.fetch(self.layer, list(slots))  # the cached claimed, the rest being read
                self._look_ahead(resid)
            for e, w in fetched:
                y = w.down(self.act(w.gate_up(x)))  # [1, H]
                for j in slots[e]:
                    ys[j : j + 1] = y
        else:
            flat = idx.reshape(-1)  # [T*k]
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()
            ends = torch.tensor(counts).cumsum(0).tolist()
            ids = [e for e, c in enumerate(counts) if c]  # the batch's union: each expert fetched once
            if fetched is None:
                fetched = self.source.fetch(self.layer, ids)
                self._look_ahead(resid)
            for e, w in fetched:
                sel = order[ends[e] - counts[e] : ends[e]]  # slots routed to expert e
                ys[sel] = w.down(self.act(w.gate_up(x[sel // k])))
        return ys

    @staticmethod
    def combine(ys: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weighted sum over each row's k slots, in slot order and in f32 (deterministic and precise):
        ys [T*k, H], weights [T, k] -> [T, H]."""
        T, k = weights.shape
        return (ys.view(T, k, -1).float() * weights.float()[..., None]).sum(1).to(dtype)

    def _look_ahead(self, resid: torch.Tensor | None) -> None:
        # After this layer's fetch (its experts are claimed: a prefetch cannot evict them).
        if resid is not None:
            self.source.look_ahead(self.layer, resid)


def routed_ids(idx: torch.Tensor) -> list[int]:
    """The experts a step's routes idx [T, k] need, in the order a layer fetches them (one row: its own order)."""
    return list(dict.fromkeys(idx[0].tolist())) if idx.shape[0] == 1 else torch.unique(idx).tolist()


def native_expert(w: ExpertWeights, like: QLinear | None = None) -> bool:
    """Both projections run the native kernel in one scheme and group size (and like `like`'s), without a
    bias or with a bf16 one on the CPU (gpt-oss's: the kernel adds it)."""
    a, b = w.gate_up, w.down
    if not (isinstance(a, QLinear) and isinstance(b, QLinear)):
        return False
    like = like or a
    return (a.path == b.path == "native" and native.bias_ok(a) and native.bias_ok(b)
            and a.scheme == b.scheme == like.scheme and a.group_size == b.group_size == like.group_size)


class TopKRouter(nn.Module):
    """Softmax over all experts, keep the top k (Mixtral, OLMoE, Qwen-MoE); optionally renormalised."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H], f32
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # one native call instead of five ops
        if routed is not None:
            return routed
        probs = torch.softmax(x.float() @ self.weight.T, dim=-1)  # [T, E]
        weights, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights

    def native_routing(self) -> RouteRule | None:
        """The native router's rule for this one (kernels/route.c coli_route). A router without this method, or
        answering None, routes in torch."""
        return RouteRule(native.ROUTE_SOFTMAX, self.norm_topk_prob)


class SoftmaxTopKRouter(nn.Module):
    """Logits (+ a bias: gpt-oss's, loaded; else zeros, Granite), keep the top k, softmax over just those k,
    times `scale` (Granite's residual multiplier; 1 for gpt-oss)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, bias: bool = True, scale: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H]
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)  # [E]
        else:  # (a buffer: nothing to load; the kernels' rule takes a bias)
            self.register_buffer("bias", torch.zeros(num_experts), persistent=False)
        self.top_k, self.scale = top_k, scale

    def native_routing(self) -> RouteRule | None:
        """The native router's rule (kernels/route.c route_select_topk_softmax); None where the bias is not an
        f32 CPU tensor."""
        b = self.bias
        if b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous():
            return None
        return RouteRule(native.ROUTE_TOPK_SOFTMAX, False, b, self.scale)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        return idx, torch.softmax(top, dim=-1) * self.scale


class BiasedLogitRouter(nn.Module):
    """The top k of logit + a selection-only bias (Kolibri-1's `e_score_correction_bias`; none: zeros, Command A's),
    weighted by the sigmoid of their unbiased logits, renormalised over the k when `norm`, times `scale`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm: bool, bias: bool = True, scale: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H]
        if bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)  # [E]
        else:  # (a buffer: nothing to load; the kernels' rule takes a bias)
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts), persistent=False)
        self.top_k, self.norm, self.scale = top_k, norm, scale

    def native_routing(self) -> RouteRule | None:
        """kernels/route.c route_select_biased_logit_sigmoid; None where the bias is not an f32 CPU tensor."""
        b = self.e_score_correction_bias
        if b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous():
            return None
        return RouteRule(native.ROUTE_LOGIT_BIAS_SIGMOID, self.norm, b, self.scale)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        logits = x.float() @ self.weight.float().T  # [T, E]
        idx = (logits + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices  # [T, k]
        weights = logits.gather(1, idx).sigmoid()  # [T, k]
        if self.norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * self.scale


def native_router_ok(w: torch.Tensor, x: torch.Tensor) -> bool:
    """Router weight w and rows x the native router takes: bf16 rows on the CPU, an f32 contiguous weight."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and w.device.type == "cpu" \
        and w.dtype == torch.float32 and w.is_contiguous() and native.available()


class RouteRule(NamedTuple):
    """A router's rule as the kernels run it (kernels/route.c coli_route), from its `native_routing()`."""

    kind: int  # native.ROUTE_*
    norm: bool  # the k weights renormalised to sum to one (ERNIE: over max(sum, scale))
    bias: torch.Tensor | None = None  # f32 [E] contiguous: a selection-only bias (gpt-oss: the logits' bias)
    scale: float = 1.0  # the weights' factor when not renormalised (ERNIE: the renormalisation floor)
    groups: tuple[int, int] = (1, 1)  # (n_group, topk_group): DeepSeek's group-limited choice (kernels/moe.c)


def native_route(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`gate`'s routes of bf16 rows x by its own rule in the kernels (`gate.native_routing()`), or None: f32
    rows (the oracle's torch path), or a rule the kernels do not have."""
    rule = native_routing(gate)
    if rule is None or not native_router_ok(gate.weight, x):
        return None
    return native.route(x.contiguous(), gate.weight, gate.top_k, rule.norm, rule.bias, rule.scale, rule.kind,
                        rule.groups)


def native_routing(gate: nn.Module) -> RouteRule | None:
    """`gate.native_routing()` where the router has one and its groups are within the kernels' limits (equal
    groups, at most 64, holding top_k experts), else None."""
    rule = getattr(gate, "native_routing", None)
    rule = rule() if rule is not None else None
    if rule is not None and rule.groups[0] > 1:
        (G, tg), E = rule.groups, gate.weight.shape[0]
        if E % G or G > native.MAX_GROUPS or not 1 <= tg <= G or gate.top_k > tg * (E // G):
            return None
    return rule


class SparseMoE(nn.Module):
    """Router + routed experts (+ an optional shared expert, optionally sigmoid-gated as in Qwen2-MoE)."""

    def __init__(self, gate: nn.Module, experts: SwitchGLU, shared: nn.Module | None = None,
                 shared_gate: nn.Module | None = None, shared_name: str = "shared_expert",
                 out_norm: nn.Module | None = None):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.shared_name = shared_name
        if shared is not None:
            setattr(self, shared_name, shared)
        if shared_gate is not None:
            self.shared_expert_gate = shared_gate
        if out_norm is not None:  # (an RMSNorm of the output, routed + shared, before the residual add: AFMoE)
            self.out_norm = out_norm

    def shared_table(self) -> native.Mlp | None | bool:
        """The shared expert's native constants (with its gate), None where the kernel does not run it,
        False where the layer has none."""
        shared = getattr(self, self.shared_name, None)
        return False if shared is None else native_mlp.table(shared, getattr(self, "shared_expert_gate", None))

    def fused(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """h + self(x, h) in one native call (router, experts, shared expert, residual: kernels/moe.c
        coli_moe_block) for a few bf16 rows of a resident layer with a router the kernel knows -- the
        bits of the unfused native path; None where it does not apply."""
        ex = self.experts
        rule = native_routing(self.gate)
        shared = self.shared_table()
        out = out_norm_ptr(self)
        if rule is None or out is None or x.shape[0] > native.MOE_MAX_ROWS \
                or not native_router_ok(self.gate.weight, x) or h.dtype != torch.bfloat16 \
                or (shared is not False and not native_mlp.applies(shared, x)):
            return None
        tables = ex.source.native_tables(ex) if ex.source.holds_all(ex.layer) else None
        if tables is None:
            return None
        ex._look_ahead(h)  # the next layer's reads start first, as on the unfused path
        h_out, idx, weights = native.moe_block(tables, x.contiguous(), h.contiguous(), self.gate.weight,
                                               self.gate.top_k, rule.norm, ex.intermediate, tables.scheme,
                                               tables.group_size, rule.bias, rule.scale, rule.kind,
                                               shared=shared or None, groups=rule.groups,
                                               out_norm=None if out[0] is None else (self.out_norm.weight, out[1]))
        ex.route = (idx, weights)
        return h_out

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] normed rows; resid [T, H] the block's residual (for the experts' look-ahead)."""
        idx, weights = self.gate(x)
        out = self.experts(x, idx, weights, resid)
        shared = getattr(self, self.shared_name, None)
        if shared is not None:
            gate = getattr(self, "shared_expert_gate", None)
            s = native_mlp.run(shared, x, gate)  # (the kernel the fused block runs: the same bits)
            if s is None:
                s = shared(x)
                if gate is not None:
                    s = torch.sigmoid(gate(x)) * s
            out = out + s
        norm = getattr(self, "out_norm", None)
        return out if norm is None else norm(out)

    def _apply(self, fn, recurse: bool = True):  # the gate moved too: the shared expert's constants go
        shared = getattr(self, self.shared_name, None)
        if shared is not None:
            native_mlp.forget(shared)
        return super()._apply(fn, recurse)
