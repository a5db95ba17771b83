"""DeepSeek-V3.2 (`deepseek_v32`, V3.2-Exp / V3.2): DeepSeek-V3's layers (deepseek_v3.py) plus DeepSeek Sparse
Attention: each attention layer's lightning indexer scores every cached position for each query and the query
attends to the `index_topk` best only.

- The indexer: q = wq_b(q_resid) [Hi, Di] (q_resid: MLA's normalised q LoRA), k = LayerNorm(wk(x)) [Di], RoPE on
  the first qk_rope_head_dim channels of both (rotate-half, where MLA rotates interleaved pairs), score(t, s) =
  sum_h w_h(x_t) Hi^-1/2 relu(q_t,h . k_s Di^-1/2) with w = weights_proj(x); the top `index_topk` causal
  positions are kept.
- Its keys are cached per position beside the latent (`IndexedLatentCache`), so a slot keeps prefixes and
  prompt caching works as for V3.
- While a sequence holds at most `index_topk` positions every position is kept: the attention is V3's dense MLA,
  native block included (the indexer's keys are still written); past that, the indexer selects in torch and bf16
  rows take the native block over the selected latents (`_fused_sparse`: gathered in position order), other rows
  torch's MLA (either form: the absorbed one, decode's, masks its latent scores). An engine whose
  context (`ctx_size`) is at most `index_topk` never selects: it caches no indexer keys and takes V3's one-call
  step; a longer one does not (that call would not write the keys).
- Layers are MoE by `mlp_layer_types`, else from `first_k_dense_replace` (3) on; RoPE pairs are interleaved.
- The MTP layer (layer `num_hidden_layers`, V3's layout) is a routed layer with an indexer of its own
  (`mtp_config`; layers/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import arena
from ..layers.batch import LayerKV
from ..layers.kvquant import DEFAULT, KVTypes, refuse_quantized
from ..layers.layers import Linear, RoPE
from ..layers.mla import LatentCache, MLAttention
from . import deepseek_v3 as v3
from .base import refuse
from .family import Family

NAME = "deepseek_v32"


@dataclass
class ModelArgs(v3.ModelArgs):
    aliases = {"num_local_experts": "n_routed_experts"}

    first_k_dense_replace: int = 3
    mlp_layer_types: list | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64

    def is_moe(self, i: int) -> bool:
        return self.n_routed_experts > 0 and layer_types(self.mlp_layer_types, self.first_k_dense_replace,
                                                         self.num_hidden_layers)[i] == "sparse"

    def rope_interleaved(self) -> bool:
        return True  # (DeepseekV32Attention rotates interleaved pairs, whatever the config says)


def layer_types(given: list | None, first_dense: int, n: int) -> list[str]:
    """transformers' DeepseekV32Config rule: `mlp_layer_types`, else the first `first_k_dense_replace` dense."""
    if given is not None:
        return list(given)
    k = min(first_dense, n)
    return ["dense"] * k + ["sparse"] * (n - k)


class IndexedLatentCache(LatentCache):
    """The MLA latent cache plus the indexer's key per position ([ctx, Di])."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, index_dim: int, max_len: int, dtype: torch.dtype,
                 device: str = "cpu"):
        super().__init__(kv_lora_rank, rope_dim, max_len, dtype, device)
        self.ik = arena.zeros((max_len, index_dim), dtype, device)

    def to(self, device):
        super().to(device)
        self.ik = self.ik.to(device)
        return self

    def parts(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv, "ik": self.ik}

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.ik.nbytes


class Indexer(nn.Module):
    """The lightning indexer's weights (checkpoint names `self_attn.indexer.*`)."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, dim: int):
        super().__init__()
        self.wq_b = Linear(q_lora_rank, heads * dim)
        self.wk = Linear(hidden, dim)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(hidden, heads)
        self.heads, self.dim = heads, dim


class Selection:
    """A step's top-k selection (per sequence, as DSAttention._selection gives it), handed from a layer that
    runs its indexer to the layers after it that share it (GLM-5's "shared" layers)."""

    keep: list | None = None


class DSAttention(MLAttention):
    """MLA with the indexer's top-k selection (module docstring). `shared`: no indexer of its own, the selection
    of the last layer before it that has one (`carrier`); `index_interleaved`: the indexer's RoPE on interleaved
    pairs (GLM-5's) rather than halves."""

    def __init__(self, mla, a: ModelArgs, shared: bool = False, carrier: Selection | None = None,
                 index_interleaved: bool = False):
        super().__init__(mla)
        self.indexer = None if shared else Indexer(a.hidden_size, a.q_lora_rank, a.index_n_heads, a.index_head_dim)
        self.topk, self.carrier = a.index_topk, carrier
        self._keep_iter = None
        self.dense = False  # (make_cache: contexts of at most index_topk positions never select)
        # the indexer's rotary: the same frequencies as MLA's
        self.index_rope = RoPE(mla.qk_rope_head_dim, mla.rope_theta, mla.rope_scaling, mla.max_pos,
                               index_interleaved)

    @property
    def one_call(self) -> bool:
        """native_step: the one-call step writes no indexer keys, so it runs only where none are needed."""
        return self.dense

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu",
                   types: KVTypes = DEFAULT) -> LatentCache:
        """A context of at most index_topk positions keeps every position for every query: the attention is V3's
        dense MLA, and the indexer never runs (no keys cached, and the one-call step applies). (On the meta
        device -- a size measurement -- the layer's own mode stays as it is.)"""
        refuse_quantized(types, "the MLA latent cache and the indexer's keys")
        a = self.a
        dense = max_len <= self.topk
        if device != "meta":
            self.dense = dense
        if self.indexer is None or dense:
            return super().make_cache(max_len, dtype, device)
        return IndexedLatentCache(a.kv_lora_rank, a.qk_rope_head_dim, self.indexer.dim, max_len, dtype, device)

    def _index_keys(self, x: torch.Tensor, kv: LayerKV) -> None:
        """The rows' indexer keys into their caches (a layer with an indexer)."""
        ix = self.indexer
        if ix is None or not all(isinstance(c, IndexedLatentCache) for *_, c in kv.segs):
            return
        k = F.layer_norm(self.indexer.wk(x).float(), (ix.dim,), ix.k_norm.weight.float(), ix.k_norm.bias.float(),
                         ix.k_norm.eps).to(x.dtype)  # [T, Di]
        k = self.index_rope(k[:, None], kv.pos)[:, 0]  # (its first rope channels)
        for r0, r1, start, cache in kv.segs:
            if start + r1 - r0 > cache.max_len:
                raise ValueError(f"context full: position {start + r1 - r0} exceeds ctx-size {cache.max_len}")
            cache.ik[start:start + r1 - r0] = k[r0:r1]

    def _sparse(self, kv: LayerKV) -> bool:
        return kv.end > self.topk

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        self._index_keys(x, kv)
        if not self._sparse(kv):
            return super().forward(x, kv)  # every position kept: V3's dense MLA
        self._keep_iter = iter(self._keeps(x, kv))  # (read by _expanded, a sequence at a time)
        try:
            return super().forward(x, kv)
        finally:
            self._keep_iter = None

    def _keeps(self, x: torch.Tensor, kv: LayerKV) -> list[torch.Tensor | None]:
        """The step's selection per sequence: this layer's indexer's (handed on to the layers sharing it), or a
        shared layer's carrier's."""
        if self.indexer is not None:
            keeps = self._selection(x, kv)
            if self.carrier is not None:
                self.carrier.keep = keeps
            return keeps
        if self.carrier is None or self.carrier.keep is None or len(self.carrier.keep) != len(kv.segs):
            raise RuntimeError("a shared sparse-attention layer ran before any layer with an indexer")
        return self.carrier.keep

    def _selection(self, x: torch.Tensor, kv: LayerKV) -> list[torch.Tensor | None]:
        """Per sequence, bool [n, S] (True: attended) where it holds more than index_topk positions."""
        ix = self.indexer
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = ix.wq_b(q_resid).view(x.shape[0], ix.heads, ix.dim)
        q = self.index_rope(q, kv.pos).float()  # [T, Hi, Di]
        w = ix.weights_proj(x).float() * ix.heads**-0.5  # [T, Hi]
        out = []
        for r0, r1, start, cache in kv.segs:
            S = start + r1 - r0
            if S <= self.topk:
                out.append(None)
                continue
            keys = cache.ik[:S].float()  # [S, Di]
            scores = F.relu(torch.einsum("thd,sd->ths", q[r0:r1], keys) * ix.dim**-0.5)  # [n, Hi, S]
            index = torch.einsum("th,ths->ts", w[r0:r1], scores)  # [n, S]
            dev = index.device
            future = torch.arange(S, device=dev)[None] > torch.arange(start, S, device=dev)[:, None]
            index = index.masked_fill(future, float("-inf"))
            keep = torch.zeros(r1 - r0, S, dtype=torch.bool, device=dev)
            keep.scatter_(1, self._top(index, start), True)
            out.append(keep & ~future)
        return out

    def _top(self, index: torch.Tensor, start: int) -> torch.Tensor:
        """The index_topk best positions of each row of index [n, S] (-inf after a row's own) -> [n, index_topk].
        Tied scores (relu's zeros tie often) are broken by topk's shape-dependent order: a prompt from its first
        position takes the batched form, as transformers does; a continuation (decode, a verify's rows, a later prompt
        chunk) redoes each row whose last kept and first dropped scores tie over its own positions alone,
        as one decode row computes it, so a verify selects what decoding one row at a time would."""
        k = self.topk
        if start == 0:
            return index.topk(k, -1).indices
        top = index.topk(k + 1, -1)  # (the set of the best k is the rows' own unless the k-th and (k+1)-th tie)
        kth, nxt = top.values[:, k - 1], top.values[:, k]
        picks = top.indices[:, :k].clone()
        for i in ((kth == nxt) & (nxt > float("-inf"))).nonzero()[:, 0].tolist():
            picks[i] = index[i, :start + i + 1].contiguous()[None].topk(k, -1).indices[0]
        return picks

    def _expanded(self, q_nope, q_pe, latent, start, keep=None):
        return super()._expanded(q_nope, q_pe, latent, start, self._next_keep(latent))

    def _absorbed(self, q_nope, q_pe, latent, start, keep=None):
        return super()._absorbed(q_nope, q_pe, latent, start, self._next_keep(latent))

    def _next_keep(self, latent: torch.Tensor) -> torch.Tensor | None:
        """This sequence's selection, on this layer's device (a shared layer may sit on another tier's)."""
        keep = next(self._keep_iter) if self._keep_iter is not None else None
        return None if keep is None else keep.to(latent.device)

    def native_form(self, T: int, S: int) -> bool:
        return S <= self.topk and super().native_form(T, S)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm):
        if h.dtype != torch.bfloat16 or h.device.type != "cpu":
            return None
        if self._sparse(kv):
            return self._fused_sparse(h, kv, in_norm, post_norm)
        out = super().fused(h, kv, in_norm, post_norm)
        if out is not None:
            self._index_keys(in_norm(h), kv)
        return out

    def _fused_sparse(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm):
        """A step past index_topk positions in kernels/mla.c's block: the indexer's selection as the torch path
        makes it, each row attending to its selected positions' latents (gathered in position order); None where
        the block does not apply (the torch path runs)."""
        if not all(MLAttention.native_form(self, r1 - r0, start + r1 - r0) and isinstance(c, LatentCache)
                   and c.native_like(c) and start + r1 - r0 <= c.max_len for r0, r1, start, c in kv.segs):
            return None  # (a full context: the torch path raises the error)
        layer = self._native_layer(in_norm, post_norm)
        if layer is None:
            return None
        x = in_norm(h)
        self._index_keys(x, kv)
        sel: list = []
        for (r0, r1, _, _), keep in zip(kv.segs, self._keeps(x, kv)):
            rows = [None] * (r1 - r0) if keep is None else [k.nonzero()[:, 0].int() for k in keep]  # ascending
            sel.extend(rows)
        return self._native_rows(layer, h.contiguous(), kv.segs, kv.pos, sel)


class Model(v3.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        mla = a.mla()
        for b in self.model.layers:  # V3's layers with the indexer in each attention
            b.self_attn = DSAttention(mla, a)


def check_config(cfg: dict) -> None:
    v3.check_config(cfg)
    if not cfg.get("q_lora_rank"):
        refuse(NAME, "q_lora_rank", cfg.get("q_lora_rank"), "the indexer reads the q LoRA: a positive rank")
    n = int(cfg.get("num_hidden_layers") or 0)
    types = layer_types(cfg.get("mlp_layer_types"), int(cfg.get("first_k_dense_replace", 3)), n)
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        refuse(NAME, "mlp_layer_types", cfg.get("mlp_layer_types"), f'{n} entries of "dense" or "sparse"')
    for key in ("index_topk", "index_head_dim", "index_n_heads"):
        v = cfg.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            refuse(NAME, key, v, "a positive integer")
    rope = int(cfg.get("qk_rope_head_dim", 64))
    if int(cfg.get("index_head_dim", 128)) < rope:
        refuse(NAME, "index_head_dim", cfg.get("index_head_dim"), f"at least qk_rope_head_dim={rope}")


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (routed, its own indexer) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0, "mlp_layer_types": ["sparse"]}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, mtp_config=mtp_config)
