"""The native backend of the decode plan (engine/decode_plan.py): a range of decoder blocks of a step in one
native call (colibri/kernels/step.c), where every layer would take the fused native blocks anyway: bf16
attention (`Attention.fused`, q/k/v/o biases included; or DeepSeek's MLA, `MLAttention.fused`, on the steps
whose every sequence takes its native block) then a resident routed-expert layer (`SparseMoE.fused`, with its
shared expert) or a dense MLP (`native_mlp`); and, where the model's ends take native calls too (bf16
embedding, f32 final norm, a native quantized head), the whole step from token ids to logits (`step`), or
several steps (`steps`). Same kernels, same order, same bits; what goes is the Python between the calls (~15%
of a small model's decode step, and each call from Python after the blocks runs cache-cold). `build` says why a
range cannot run so (a GPU layer, another router, ...); a step whose rows do not fit it (too many, a cache of
another kind) gets None back.

Layers whose experts an expert cache serves (the disk tier) run in the same call over tables the cache keeps
equal to the experts in memory (`ExpertSource.native_tables`), through the layer hook (engine/stream_hook.py):
once such a layer is routed, the engine claims its experts and starts reading the missing ones, the kernel
predicts the next routed layer's routes and the engine starts those reads too, then the kernel computes the
experts in memory while the rest land, each as it lands. Only a layer whose landed expert could not enter the
table (COLI_MISS) stops the call; it then runs the per-layer way and the call resumes after it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native, native_block, native_mla, native_run
from ..layers import native_mlp
from ..layers.attention import Attention, KVCache
from ..layers.batch import StepBatch
from ..layers.layers import MLP, DecoderBlock
from ..layers.mla import LatentCache, MLAttention
from ..layers.moe import SparseMoE, native_routing
from ..layers.norms import block_norm_bias, out_norm_ptr
from ..quant import QLinear
from . import stream_hook
from .stats import StackedRoutes


class NativeLayers:
    """The per-layer constants of coli_decode_layers for the blocks lo..lo+len(blocks)-1 of a model, built once
    by `build` (engine/decode_plan.py holds it)."""

    def __init__(self, blocks: list[DecoderBlock], attn: list[native_block.AttnLayer],
                 tables: list[native.MoeTables | None], mlps: list[native.Mlp | None], keep: list, lo: int = 0,
                 whole: bool = True):
        self.blocks = blocks
        self.lo = lo  # the model's index of blocks[0]: a slot's caches and the step's LayerKVs are the model's
        self.whole = whole  # every layer of the model (a step's routes handed over at once)
        self.keep = keep  # the MLA layers' structs the AttnLayers point to
        # an MLA model's first attention: whether a step takes the block depends on its rows (_args)
        self.mla = blocks[0].self_attn if isinstance(blocks[0].self_attn, MLAttention) else None
        self.sparse = [i for i, t in enumerate(tables) if t is not None]  # the routed layers' indices
        self.experts = [blocks[i].mlp.experts for i in self.sparse]
        self.layers = [ex.layer for ex in self.experts]
        self.source = self.experts[0].source if self.experts else None  # (one ExpertSource serves every layer)
        # the routed layers an expert cache serves (indices into blocks), and their model layers
        self.cached = [i for i, ex in zip(self.sparse, self.experts) if not ex.source.holds_all(ex.layer)]
        self.cached_layers = [blocks[i].mlp.experts.layer for i in self.cached]
        self.all_sparse = len(self.sparse) == len(blocks)
        self.rope = blocks[0].self_attn.rope
        # (a model with no routed layer writes no routes: k 1 only keeps the kernels' route buffers non-empty)
        self.k = blocks[self.sparse[0]].mlp.gate.top_k if self.sparse else 1
        self.tables, self.mlps = tables, mlps  # the MoeLayer structs point into them: keep them alive
        self.attn = (native_block.AttnLayer * len(attn))(*attn)
        self.moe = (native.MoeLayer * len(blocks))(*[self._layer(b, t, m) for b, t, m in zip(blocks, tables, mlps)])
        # where experts stream: the routed layers call back as they run (claims, reads, look-ahead)
        self.hook = self._hook(tables) if self.cached else None
        self.slots: dict[int, _Slot] = {}  # id(caches) -> its pointers
        self.ptrs: dict[tuple, tuple] = {}  # a step's row layout -> (its _Slots, K and V pointer arrays)
        self.tail: _Tail | None = None  # embedding, final norm and head in the same call, where they allow
        self.rope_tab: tuple[torch.Tensor, torch.Tensor] | None = None  # the f32 rotary tables the call reads ...
        self.rope_ptrs = (0, 0, 0)  # ... as (cos pointer, sin pointer, rows)
        self.rope_rows = 0  # positions every table the call reads holds
        self.rope_alt, self.alt = None, []  # a second rotary embedding and the layers it serves (_build)
        self.alt_tab: tuple[torch.Tensor, torch.Tensor] | None = None  # its tables ...
        self.alt_rotary = native_block.AttnRotary()  # ... as those layers' rotary variant points to them
        # positions the layers take (Llama 4's temperature tables end somewhere)
        self.pos_limit = min((b.self_attn.pos_limit() for b in blocks if hasattr(b.self_attn, "pos_limit")),
                             default=1 << 62)

    def _layer(self, b: DecoderBlock, t: native.MoeTables | None, mlp: native.Mlp | None) -> native.MoeLayer:
        shared = None if mlp is None else ctypes.addressof(mlp)
        out_w, out_eps = out_norm_ptr(b.mlp)  # (_build checked that the kernels take it)
        if t is None:  # a dense layer: its MLP alone
            return native.MoeLayer(0, 0, self.k, 0, mlp.scheme, mlp.group, None, None, None, None, 1.0, shared,
                                   native.ROUTE_SOFTMAX, None, out_w=out_w, out_eps=out_eps)
        r = native_routing(b.mlp.gate)
        return native.MoeLayer(b.mlp.experts.intermediate, t.n, b.mlp.gate.top_k, int(r.norm),
                               8 if t.scheme == "int8" else 4, t.group_size, b.mlp.gate.weight.data_ptr(),
                               ctypes.addressof(t.gu), ctypes.addressof(t.dn),
                               None if r.bias is None else r.bias.data_ptr(), r.scale, shared, r.kind,
                               None if t.act_ptr() is None else ctypes.addressof(t.act), *r.groups,
                               out_w=out_w, out_eps=out_eps)

    def _hook(self, tables: list) -> stream_hook.LayerHook:
        """The layer hook, set in the structs of the cached layers and of those whose look-ahead reads a cached
        layer's experts."""
        ahead = {} if self.source.ahead is None else self.source.ahead.next
        hook = stream_hook.LayerHook(self.source, {self.blocks[i].mlp.experts.layer: tables[i] for i in self.cached},
                                     self.k, self.attn[0].hidden)
        index = {ex.layer: i for i, ex in zip(self.sparse, self.experts)}
        for i, ex in zip(self.sparse, self.experts):
            if i in self.cached or ex.layer in ahead:
                self.moe[i].hook, self.moe[i].layer = hook.fn, ex.layer
                # the kernel predicts the next routed layer's routes where it has that layer's norm and router
                n = index.get(ahead[ex.layer][0], -1) if ex.layer in ahead else -1
                if n > i and self.attn[n].post_w and not self.attn[n].mla:
                    self.moe[i].ahead = n - i
        return hook

    def routed(self, idx: torch.Tensor) -> torch.Tensor:
        """The routed layers' rows of routes [..., L, T, k] (a dense layer's rows are not written)."""
        return idx if self.all_sparse else idx[..., self.sparse, :, :]

    def __del__(self) -> None:
        # Before the weights it points into can go: the kernels' read-ahead may be reading them. (At
        # interpreter exit the module may be gone already; the atexit hook has waited then.)
        try:
            native.background_wait()
        except (AttributeError, TypeError):
            pass

    def rope_tables(self, end: int) -> tuple[int, int, int]:
        """The rotary tables' pointers, grown to hold positions < end (the tensors kept: the rope may
        replace its own when it grows them)."""
        if end > self.rope_rows:
            cos, sin = self.rope_tab = self.rope.all_rows(end, torch.float32)
            self.rope_ptrs = (cos.data_ptr(), sin.data_ptr(), cos.shape[0])
            self.rope_rows = cos.shape[0]
            if self.alt:
                cos, sin = self.alt_tab = self.rope_alt.all_rows(end, torch.float32)
                self.alt_rotary.cos, self.alt_rotary.sin, self.alt_rotary.rows = cos.data_ptr(), sin.data_ptr(), \
                    cos.shape[0]
                self.rope_rows = min(self.rope_rows, cos.shape[0])  # (grown again when either is short)
        return self.rope_ptrs


def one_call_shape(blocks) -> bool:
    """Whether the model's layers have the shape the one-call step runs (whatever their weights): attention,
    then routed experts with a router the kernels run and one top_k (plus, optionally, a shared expert as a
    dense SwiGLU MLP behind at most a sigmoid gate), or a dense SwiGLU MLP (every layer one: a dense model). The
    planner asks this of a model skeleton; `build` also needs the weights resident, quantized and on the CPU."""
    return shape_problem(blocks) is None


def shape_problem(blocks, lo: int = 0) -> str | None:
    """Why `one_call_shape` is False, naming the first layer that does not fit (lo: the model's index of
    blocks[0]); None where the shape fits."""
    ks = set()
    for i, b in enumerate(blocks, lo):
        # (a subclass of these with its own `fused` runs the same kernels: Llama 4's attention and MoE; layers of
        # two such attention classes take one call where both are standard attention, MiniMax-M3's dense and sparse)
        if type(b) is not DecoderBlock:
            return f"layer {i} is a {type(b).__name__}"
        if _attn_kind(b.self_attn) is not _attn_kind(blocks[0].self_attn) or not _fusable(
                b.self_attn, (Attention, MLAttention)) or not getattr(b.self_attn, "one_call", True):
            return f"layer {i}: {type(b.self_attn).__name__} has no one-call kernel"
        if not _fusable(b.mlp, (SparseMoE, MLP)):
            return f"layer {i}: {type(b.mlp).__name__} has no one-call kernel"
        moe = b.mlp
        if isinstance(moe, MLP):
            continue
        shared = getattr(moe, moe.shared_name, None)
        if native_routing(moe.gate) is None:
            return f"layer {i}: {type(moe.gate).__name__}'s routing has no kernel"
        if shared is not None and not _dense_mlp(shared):
            return f"layer {i}: the shared expert {type(shared).__name__} has no kernel"
        ks.add(moe.gate.top_k)
    return None if len(ks) <= 1 else f"layers route to different top-k ({sorted(ks)})"


def _weights(attn: nn.Module) -> str:
    """What an attention layer's projection holds, for the plan's reason: its scheme, or its module's kind."""
    p = next((m for m in attn.children() if isinstance(m, QLinear)), None)
    if p is None:
        return f"{type(attn).__name__}'s weights"
    return f"{p.scheme} attention weights" + ("" if p.path == "native" else f" on the {p.path} path")


def _fusable(m: nn.Module, kinds: tuple[type, ...]) -> bool:
    return type(m) in kinds or (isinstance(m, kinds) and "fused" in type(m).__dict__) or _dense_mlp(m)


def _attn_kind(m: nn.Module) -> type:
    return MLAttention if isinstance(m, MLAttention) else Attention


def _dense_mlp(m: nn.Module) -> bool:
    """An MLP the kernels' MLP call runs: SwiGLU, or a subclass naming the call's activation (`native_act`)."""
    return type(m) is MLP or (isinstance(m, MLP) and "native_act" in type(m).__dict__)


def build(blocks: list, lo: int = 0, whole: bool = True) -> NativeLayers | str:
    """The one-call constants of blocks (the model's layers lo..lo+len(blocks)-1), or why they cannot run
    in one call: the kernels missing, a layer of another shape, weights not resident, quantized and on the CPU."""
    if not native.available():
        return f"native kernels unavailable: {native.why_unavailable()}"
    problem = shape_problem(blocks, lo)
    if problem is not None:
        return problem
    attn, tables, mlps, keep = [], [], [], []
    ropes: list = []  # the distinct rotary embeddings: the first layer's table is the call's, a second one's
    alt: list[int] = []  # layers' own (coli_attn_layer.rotary: MiMo-V2-Flash's sliding layers)
    for i, b in enumerate(blocks):
        rope = b.self_attn.rope
        same = [r for r in ropes
                if r.dim == rope.dim and r.mscale == rope.mscale and torch.equal(r.inv_freq, rope.inv_freq)]
        if not same:
            if ropes and (len(ropes) == 2 or isinstance(b.self_attn, MLAttention)):
                return f"layer {lo + i}: a third rotary table"  # (at most two; MLA's block takes the call's)
            ropes.append(rope)
        if (same[0] if same else rope) is not ropes[0]:
            alt.append(i)
        layer = b.self_attn._native_layer(b.input_layernorm, b.post_attention_layernorm)
        if layer is None or getattr(b.self_attn, "mode", None) == "expanded":
            return f"layer {lo + i}: {_weights(b.self_attn)} (the kernels take int8/int4 attention on the CPU)"
        if isinstance(layer, native_mla.MlaLayer):  # the MLA block in the attention block's place
            keep.append(layer)
            layer = native_block.AttnLayer(hidden=layer.hidden, rot=layer.rope, mla=ctypes.addressof(layer))
        attn.append(layer)
        if out_norm_ptr(b.mlp) is None:
            return f"layer {lo + i}: an output norm the kernels do not take"
        if isinstance(b.mlp, MLP):
            mlp, t = native_mlp.table(b.mlp), None
        else:
            ex = b.mlp.experts
            w = b.mlp.gate.weight
            if ex.source is None or w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous():
                return f"layer {lo + i}: its router is not an f32 CPU tensor"
            # (a resident layer's look-ahead reads the next, cached, layer's experts: not run in the call)
            mlp, t = b.mlp.shared_table(), ex.source.native_tables(ex)
            if t is None:
                return f"layer {lo + i}: experts the kernels do not take (not int8/int4 on the CPU)"
        if mlp is None:
            return f"layer {lo + i}: an MLP the kernels do not run"
        tables.append(t)
        mlps.append(mlp or None)
    plan = NativeLayers(list(blocks), attn, tables, mlps, keep, lo, whole)
    plan.rope_alt, plan.alt = (ropes[1], alt) if alt else (None, [])
    for i in plan.alt:  # (the tables themselves set by rope_tables, before any call)
        plan.attn[i].rotary = native_block.ref(plan.alt_rotary)
    return plan


@dataclass
class _Tail:
    """The model's embedding, final norm and head for coli_decode_step, and the tensors they point into."""

    struct: native.Tail
    keep: tuple  # the tensors behind the pointers
    max_rows: int


def tail(model: nn.Module) -> _Tail | None:
    """Where the ends of the model take the native calls anyway (bf16 embedding rows, an f32 RMSNorm or
    LayerNorm, a native quantized head with a bf16 bias or none, bf16 compute): the same calls in one, else None."""
    emb, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
    w = emb.weight
    if w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.is_contiguous() \
            or emb.out_dtype != torch.bfloat16:
        return None
    nw, nb = norm.weight, block_norm_bias(norm)  # (nb: a LayerNorm's bias pointer, None for an RMSNorm)
    if nb is False or nw.dtype != torch.float32 or nw.device.type != "cpu" or not nw.is_contiguous():
        return None
    if type(head) is not QLinear or head.path != "native" or head.compute_dtype != torch.bfloat16 \
            or head.scheme not in ("int8", "int4") or head.qweight.device.type != "cpu" or not native.bias_ok(head):
        return None
    q, sc, mn = native.qw(head)
    hb = None if head.bias is None else head.bias.data_ptr()
    t = native.Tail(w.data_ptr(), w.shape[0], nw.data_ptr(), float(norm.eps), native.QW(q, sc, mn),
                    8 if head.scheme == "int8" else 4, head.group_size if head.scheme == "int4" else 0,
                    head.out_features, nb, hb)
    return _Tail(t, (w, nw, getattr(norm, "bias", None), head.qweight, head.scale, getattr(head, "min", None),
                     head.bias), min(head.fused_max_rows, native.MOE_MAX_ROWS))


@dataclass
class _Slot:
    """One slot's per-layer cache pointers for coli_decode_layers."""

    caches: list  # the slot's list (identity checked)
    k: list  # per layer: the cache tensors the pointers were taken from (identity checked) ...
    v: list
    k_ptr: list[int]  # ... and their data pointers
    v_ptr: list[int]
    ks: int  # head strides, the same in every layer
    vs: int
    ctx: int
    kvt: int  # the caches' storage (kernels' `kvt`: K type | V type << 4; layers/kvquant.py)


def _kv(c) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer cache's K and V tensors as the kernels take them (an MLA latent cache: its one tensor as K)."""
    return (c.kv, c.kv) if isinstance(c, LatentCache) else (c.k, c.v)


def _slot(plan: NativeLayers, caches: list) -> _Slot | None:
    """A slot's per-layer cache pointers, cached by the identity of its list and of each cache's
    tensors (a cache moved or replaced gets new pointers, never stale ones)."""
    hit = plan.slots.get(id(caches))
    mine = caches[plan.lo : plan.lo + len(plan.blocks)]  # (the slot holds every layer's; these are the range's)
    if hit is not None and hit.caches is caches \
            and all(a is k and b is v for (a, b), k, v in zip(map(_kv, mine), hit.k, hit.v)):
        return hit
    c0 = mine[0] if mine else None
    kind = LatentCache if plan.mla is not None else KVCache
    if len(mine) != len(plan.blocks) or not all(isinstance(c, kind) and c.native_like(c0)
                                                and c.max_len == c0.max_len for c in mine):
        return None
    kv = [_kv(c) for c in mine]
    ks, vs = (0, 0) if kind is LatentCache else (c0.k.stride(0), c0.v.stride(0))
    hit = _Slot(caches, [k for k, _ in kv], [v for _, v in kv], [k.data_ptr() for k, _ in kv],
                [v.data_ptr() for _, v in kv], ks, vs, c0.max_len, 0 if kind is LatentCache else c0.types.code)
    if len(plan.slots) > 64:
        plan.slots.clear()
    plan.slots[id(caches)] = hit
    return hit


def _args(plan: NativeLayers, batch: StepBatch, T: int, steps: int = 1) -> tuple | None:
    """The step's per-row positions and KV cache pointers, its head strides and rotary rows, for `steps`
    steps from there (a native run: each row one position further a step); None where a sequence's caches
    do not fit the one-call path. The pointer arrays depend only on which slots sit at which rows: kept
    while that layout repeats (every decode step of the same requests)."""
    key = tuple((id(s.caches), s.r1 - s.r0) for s in batch.seqs)
    slots = [_slot(plan, s.caches) for s in batch.seqs]
    pos: list[int] = []
    for s, slot in zip(batch.seqs, slots):
        if slot is None or s.start + s.r1 - s.r0 + steps - 1 > min(slot.ctx, plan.pos_limit) \
                or (slot.ks, slot.vs, slot.kvt) != (slots[0].ks, slots[0].vs, slots[0].kvt):
            return None  # (a full context: the per-layer path raises the error)
        if plan.mla is not None and not plan.mla.native_form(s.r1 - s.r0, s.start + s.r1 - s.r0):
            return None  # (as MLAttention.fused: e.g. the expanded form in torch, "expanded" mode)
        pos.extend(range(s.start, s.start + s.r1 - s.r0))
    ptrs = plan.ptrs.get(key)
    if ptrs is None or any(a is not b for a, b in zip(ptrs[0], slots)):
        ptrs = plan.ptrs[key] = (slots, *_pointers(len(plan.blocks), batch, slots, T))
        if len(plan.ptrs) > 64:
            plan.ptrs.clear()
            plan.ptrs[key] = ptrs
    return ((ctypes.c_int * T)(*pos), ptrs[1], ptrs[2], slots[0].ks, slots[0].vs,
            plan.rope_tables(max(pos) + steps)), slots[0].kvt


def _pointers(L: int, batch: StepBatch, slots: list[_Slot], T: int) -> tuple:
    """Per (layer, row) the row's sequence's K and V cache base pointers: ctypes void* [L * T] each."""
    kc: list[int] = [0] * (L * T)
    vc: list[int] = [0] * (L * T)
    for s, slot in zip(batch.seqs, slots):
        n = s.r1 - s.r0
        for layer in range(L):
            base = layer * T + s.r0
            kc[base:base + n] = [slot.k_ptr[layer]] * n
            vc[base:base + n] = [slot.v_ptr[layer]] * n
    return (ctypes.c_void_p * (L * T))(*kc), (ctypes.c_void_p * (L * T))(*vc)


def _routes(plan: NativeLayers, idx: torch.Tensor, wts: torch.Tensor, lo: int = 0, hi: int | None = None):
    """A call's routes (idx / wts [L, T, k]) as a mapping MoE layer -> (ids [T, k], weights [T, k]): stacked
    where the call ran every layer of the model (the per-layer views made only when asked), else the blocks
    lo..hi-1's (a call stopped or resumed there)."""
    if plan.whole and lo == 0 and hi is None:
        return StackedRoutes(plan.layers, plan.routed(idx), plan.routed(wts))
    hi = len(plan.blocks) if hi is None else hi
    return {ex.layer: (idx[i], wts[i]) for ex, i in zip(plan.experts, plan.sparse) if lo <= i < hi}


def step(plan: NativeLayers, tl: _Tail, tokens: torch.Tensor, batch: StepBatch, out_rows: torch.Tensor | None
         ) -> tuple[torch.Tensor, StackedRoutes] | None:
    """The step's logits f32 [len(out_rows), V] (all T rows when out_rows is None) from one native call --
    embedding, blocks, final norm, head -- and its routes; None where this step's rows do not fit it (too many
    rows, a cache the kernels do not take, a full context)."""
    T = tokens.shape[0]
    rows = torch.arange(T) if out_rows is None else out_rows
    if T > native.MOE_MAX_ROWS or rows.shape[0] == 0 or rows.shape[0] > tl.max_rows or rows.dtype != torch.int64:
        return None
    got = _args(plan, batch, T)
    if got is None:
        return None
    args, kvt = got
    if tokens.dtype != torch.int64 or not tokens.is_contiguous():
        tokens = tokens.to(torch.int64).contiguous()
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if plan.hook is None:
        logits, idx, wts = native.decode_step(tl.struct, tokens, plan.attn, plan.moe, *args, plan.k, rows, kvt=kvt)
        return logits, _routes(plan, idx, wts)
    got = plan.hook.run(native.decode_step, tl.struct, tokens, plan.attn, plan.moe, *args, plan.k, rows, kvt=kvt,
                        partial=True)
    if got is None:  # (an expert the hook could not put in the table: the layer-by-layer form takes the step)
        return None
    logits, idx, wts = got
    return logits, _routes(plan, idx, wts)


def steps(plan: NativeLayers, tl: _Tail, tokens: list[int], batch: StepBatch, n_steps: int, stop: torch.Tensor,
          sampling: list[tuple[float, int, float, float]] | None = None,
          uniforms: list[list[float]] | None = None, processors: list | None = None,
          logprobs: list[int | None] | None = None) -> tuple[list[list[int]], torch.Tensor, list | None] | None:
    """Up to n_steps decode steps of the batch's sequences (one row each) in one native call
    (coli_decode_run): `tokens` fed at their sequences' positions, each row's pick fed to it at the next
    (the argmax, or kernels/sample.c with `sampling[t]` and `uniforms[t]`, after `processors[t]`, an
    engine/sampling.py RunProcs or None: native_run.decode_run), ending after
    a step in which a row picked a token of `stop` (int64 [S]) -> (per step the rows' tokens, the steps'
    expert ids [n, L, T, k], per step and row the log-probs `logprobs[t]` asks for); None where these rows do
    not fit it."""
    T = len(tokens)
    if T > tl.max_rows or any(s.r1 - s.r0 != 1 for s in batch.seqs):
        return None
    got = _args(plan, batch, T, n_steps)
    if got is None:
        return None
    (pos, kc, vc, ks, vs, rope), kvt = got
    out, idx, _, lps = native_run.decode_run(tl.struct, tokens, plan.attn, plan.moe, list(pos), kc, vc, ks,
                                             vs, rope, plan.k, n_steps, stop, sampling, uniforms, processors,
                                             logprobs, kvt=kvt)
    return out, plan.routed(idx), lps


def layers(plan: NativeLayers, h: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, dict] | None:
    """The blocks' output for h [T, hidden] (h itself, overwritten, when contiguous) and their routes, or None
    where this step's rows do not fit the call. Cached layers wait for their reads inside the call (the hook);
    one whose expert could not enter its table runs the per-layer way (its routes are its experts' `route`),
    and the call resumes after it."""
    T = h.shape[0]
    if T > native.MOE_MAX_ROWS or h.dtype != torch.bfloat16 or h.device.type != "cpu":
        return None
    got = _args(plan, batch, T)
    if got is None:
        return None
    args, kvt = got
    h = h.contiguous()  # (this step's own tensor, the embedding's output: overwritten in place)
    if not plan.cached:
        idx, wts, _ = native.decode_layers(plan.attn, plan.moe, h, *args, plan.k, kvt=kvt)
        return h, _routes(plan, idx, wts)
    L, first, routes, hook = len(plan.blocks), 0, {}, plan.hook
    while first < L:
        plan.source.collect_landed(plan.cached_layers)
        idx, wts, stop = hook.run(native.decode_layers, plan.attn, plan.moe, h, *args, plan.k, partial=True,
                                  first=first, kvt=kvt)
        end = L if stop is None else stop
        routes.update(_routes(plan, idx, wts, first, end))
        if stop is None:
            break
        block = plan.blocks[stop]
        h = block(h, batch.layer(plan.lo + stop)).contiguous()  # (its attention again: the same K/V)
        ex = block.mlp.experts
        if ex.route is not None:
            routes[ex.layer], ex.route = ex.route, None
        first = stop + 1
    return h, routes
