"""MiniMax-M3's text model (`minimax_m3_vl_text`; the released multimodal `minimax_m3_vl`, MiniMax-M3, converts to
it: its vision tower and projector are dropped). MiniMax-M2's layers with:

- Gemma's zero-centred RMSNorms everywhere (weights applied as 1 + w: stored so, `prepare`), q/k norms per head;
- partial RoPE over the first `rotary_dim` channels of each head, the release's field (transformers' M3 port reads
  only `rope_parameters.partial_rotary_factor` and without one rotates whole heads; a config giving both agrees);
- "MiniMax Sparse Attention" on the `minimax_m3_sparse` layers: a lightning indexer (`index_n_heads` = the KV heads,
  q/k projections of width `index_head_dim` with their own norms and the same RoPE) scores each query against every
  earlier key, max-pools the scores over blocks of `index_block_size` keys, always keeps the query's own block
  (`index_local_blocks`) and keeps the `index_topk_blocks` best; each KV group attends to its own blocks' keys;
- the SwiGLU of gpt-oss (clamped at `swiglu_limit`, sigmoid gain `swiglu_alpha`, (up + 1) x gate) in the experts,
  the shared expert and the dense layers (`mlp_layer_types`), the experts' halves not interleaved;
- MiniMax-M2's router (sigmoid scores, a selection bias, renormalised) times `routed_scaling_factor`, beside one
  shared expert of `shared_intermediate_size`.

The multi-token-prediction modules (`model.mtp.layers.{j}`, `num_mtp_modules`: enorm, hnorm, eh_proj, one sparse MoE
layer under `transformer_layer.`, `final_layernorm`, its norms zero-centred too; vLLM's layout) are kept
(layers/mtp.py, `mtp_config`).

While a sequence holds at most index_topk_blocks x index_block_size positions every block is kept: the sparse layers
are dense attention. A context (`ctx_size`) that small never selects, so it caches no indexer keys and takes the
native blocks and the one-call step; a larger one caches each sparse layer's indexer keys and, past that many
positions, selects (kernels/msa.c, or torch's `_blocks` for f32 / GPU rows) and attends over the kept blocks in the
kernels' block (coli_attn_keep) or in torch.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import arena
from ..convert.safetensors_reader import SplitRows
from ..kernels import native, native_block, native_msa
from ..layers import mtp, native_mlp
from ..layers.attention import Attention, AttentionArgs, KVCache, Positions, QKNorm
from ..layers.batch import LayerKV
from ..layers.kvquant import DEFAULT, KVTypes, refuse_quantized
from ..layers.layers import MLP, DecoderBlock, Linear, RMSNorm, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first, text_model_name
from .family import Family
from .glm4_moe import GroupLimitedRouter
from .gpt_oss import clamped_swiglu

NAME = "minimax_m3_vl_text"
KINDS = ("full_attention", "minimax_m3_sparse")
MLP_KINDS = ("dense", "sparse")
# the released configs' `sparse_attention_config` keys -> transformers' flat fields
LEGACY = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
          "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
          "index_local_blocks": "sparse_local_block"}


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 3072  # (each routed expert's)
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    rotary_dim: int = 64
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 524288
    raw: dict | None = None

    def __post_init__(self):
        raw, n = self.raw or {}, self.num_hidden_layers
        sparse = raw.get("sparse_attention_config") or {}
        for flat, legacy in LEGACY.items():  # (transformers: the legacy block wins over the flat fields)
            if legacy in sparse:
                setattr(self, flat, int(sparse[legacy]))
        if self.layer_types is None:
            freq = sparse.get("sparse_attention_freq")
            self.layer_types = [KINDS[bool(f)] for f in freq] if freq is not None else [KINDS[0]] * n
        if self.mlp_layer_types is None:
            freq = raw.get("moe_layer_freq")
            self.mlp_layer_types = [MLP_KINDS[bool(f)] for f in freq] if freq is not None else [MLP_KINDS[1]] * n

    @property
    def span(self) -> int:
        """Positions a sequence holds before a sparse layer drops any block."""
        return self.index_topk_blocks * self.index_block_size


class ClampedMLP(MLP):
    """A dense MLP (or the shared expert) under gpt-oss's clamped SwiGLU; the release's gate_up_proj [2I, H] read as
    gate_proj and up_proj (`source_view`). The kernels' MLP call takes it (ACT_CLAMPED)."""

    native_act = native.ACT_CLAMPED

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float):
        super().__init__(hidden, intermediate)
        self.clamp = (alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_mlp.run(self, x)  # (bf16 decode rows of native weights: one call)
        if y is None:
            y = self.down_proj(clamped_swiglu(torch.cat((self.gate_proj(x), self.up_proj(x)), -1), *self.clamp))
        return y


class IndexedKVCache(KVCache):
    """The layer's keys and values plus the indexer's key per position ([1, ctx, Di]: positions on dim 1, as k's)."""

    def __init__(self, kv_heads: int, head_dim: int, index_dim: int, max_len: int, dtype: torch.dtype,
                 device: str = "cpu"):
        super().__init__(kv_heads, head_dim, max_len, dtype, None, device)
        self.ik = arena.zeros((1, max_len, index_dim), dtype, device)

    def to(self, device):
        super().to(device)
        self.ik = self.ik.to(device)
        return self

    def parts(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "ik": self.ik}

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.ik.nbytes


class Indexer(nn.Module):
    """The lightning indexer's weights (checkpoint names `self_attn.indexer.*`)."""

    def __init__(self, hidden: int, heads: int, dim: int, eps: float):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q_proj = Linear(hidden, heads * dim)
        self.k_proj = Linear(hidden, dim)
        self.q_norm, self.k_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)


class SparseAttention(Attention):
    """Attention whose KV groups attend to the blocks the indexer selects (module docstring)."""

    def __init__(self, a: AttentionArgs, m: ModelArgs):
        super().__init__(a)
        self.indexer = Indexer(a.hidden, m.index_n_heads, m.index_head_dim, a.norm_eps)
        self.block, self.topk, self.local, self.span = (m.index_block_size, m.index_topk_blocks, m.index_local_blocks,
                                                         m.span)
        self.dense = False  # (make_cache: a context of at most `span` positions never selects)

    @property
    def one_call(self) -> bool:
        """native_step: the one-call step writes no indexer keys, so it runs only where none are needed."""
        return self.dense

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> KVCache:
        dense = max_len <= self.span
        if device != "meta":  # (a size measurement leaves the layer's mode as it is)
            self.dense = dense
        if dense:
            return super().make_cache(max_len, dtype, device, types)
        refuse_quantized(types, "a sparse-attention cache (its kernel gathers 16-bit keys)")  # (past `span` positions)
        return IndexedKVCache(self.a.kv_heads, self.a.head_dim, self.indexer.dim, max_len, dtype, device)

    def _index_keys(self, x: torch.Tensor, kv: LayerKV) -> None:
        """The rows' indexer keys (normed, rotated) into their caches."""
        if not all(isinstance(c, IndexedKVCache) for *_, c in kv.segs):
            return
        ix = self.indexer
        k = self.rope(ix.k_norm(ix.k_proj(x))[:, None], kv.pos)[:, 0]  # [T, Di]
        for r0, r1, start, cache in kv.segs:
            if start + r1 - r0 > cache.max_len:
                raise ValueError(f"context full: position {start + r1 - r0} exceeds ctx-size {cache.max_len}")
            cache.ik[0, start:start + r1 - r0] = k[r0:r1]

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        self._index_keys(x, kv)
        return super().forward(x, kv)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernels' block (the indexer's keys written from the normed rows first); past `span` positions with
        each row's kept blocks (coli_attn_keep), selected as the torch path selects."""
        if h.dtype != torch.bfloat16 or h.device.type != "cpu" or h.shape[0] > native.MOE_MAX_ROWS:
            return None
        layer = self._native_layer(in_norm, post_norm)
        if layer is None:
            return None
        if self.dense:  # (no indexer keys: a context of at most `span` positions)
            return super().fused(h, kv, in_norm, post_norm)
        x = in_norm(h)
        self._index_keys(x, kv)
        if kv.end <= self.span:
            return super().fused(h, kv, in_norm, post_norm)
        keys = [cache.ik[0, :start + i + 1] for r0, r1, start, cache in kv.segs for i in range(r1 - r0)]
        keep = native_msa.select(self._index_queries(x, kv), keys, self.block, self.topk, self.local)  # [T, Hkv, nb]
        layer.keep = native_block.ref(native_block.AttnKeep(keep.data_ptr(), self.block, keep.shape[-1]))
        try:
            return super().fused(h, kv, in_norm, post_norm)
        finally:
            layer.keep = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, x: torch.Tensor) -> torch.Tensor:
        if kv.end <= self.span:
            return super().attend(q, k, v, kv, x)  # every block kept: dense attention
        a, iq = self.a, self._index_queries(x, kv)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D], [Hkv, T, D] x2
        outs = []
        for r0, r1, start, cache in kv.segs:
            k_all, v_all = cache.update(k[:, r0:r1], v[:, r0:r1], start)
            S = start + r1 - r0
            blocks = self._blocks(iq[r0:r1], cache.ik[0, :S].float(), start)  # [Hkv, n, nb]
            future = torch.arange(S, device=q.device)[None] > torch.arange(start, S, device=q.device)[:, None]
            mask = blocks.repeat_interleave(self.block, -1)[..., :S] & ~future  # [Hkv, n, S]
            # a KV group a batch entry, its query heads the heads: no copy of K/V or of the mask per query head
            n, Hkv = r1 - r0, a.kv_heads
            o = F.scaled_dot_product_attention(q[:, r0:r1].reshape(Hkv, -1, n, q.shape[-1]), k_all[:, None, :S],
                                               v_all[:, None, :S], attn_mask=mask[:, None], scale=self.scale,
                                               enable_gqa=True)  # [Hkv, rep, n, Dv]
            outs.append(o.reshape(a.heads, n, -1).transpose(0, 1).reshape(n, -1))
        return self.out(outs[0] if len(outs) == 1 else torch.cat(outs), x)

    def _index_queries(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """The indexer's queries of the step's normed rows x: normed, rotated, f32 [T, Hi, Di]."""
        ix = self.indexer
        return self.rope(ix.q_norm(ix.q_proj(x).view(x.shape[0], ix.heads, ix.dim)), kv.pos).float()

    def _blocks(self, iq: torch.Tensor, keys: torch.Tensor, start: int) -> torch.Tensor:
        """One sequence's rows iq [n, Hi, Di] at positions start.. over its indexer keys [S, Di] -> bool [Hi, n, nb]:
        each head's kept blocks of `block` keys (the query's own `local` ones and the `topk` best by their keys' best
        score; none after the query)."""
        n, S, B = iq.shape[0], keys.shape[0], self.block
        dev = iq.device
        pos = torch.arange(start, start + n, device=dev)  # [n]
        future = torch.arange(S, device=dev)[None] > pos[:, None]  # [n, S]
        scores = torch.einsum("nhd,sd->hns", iq, keys).masked_fill(future, float("-inf"))  # [Hi, n, S]
        nb = -(-S // B)
        scores = F.pad(scores, (0, nb * B - S), value=float("-inf"))
        blocks = scores.view(*scores.shape[:2], nb, B).amax(-1)  # [Hi, n, nb]
        local = (pos[:, None] // B - torch.arange(self.local, device=dev)).clamp(min=0)  # [n, local]
        blocks.scatter_(-1, local.expand(blocks.shape[0], -1, -1), float("inf"))
        top = blocks.topk(min(self.topk, nb), -1)
        chosen = torch.zeros_like(blocks, dtype=torch.bool)
        return chosen.scatter_(-1, top.indices, top.values != float("-inf"))


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw, 5e6), rope_scaling(raw), a.max_position_embeddings,
                                       rotary_dim=a.rotary_dim), qk_norm=QKNorm.HEAD, norm_eps=a.rms_norm_eps)
        act = functools.partial(clamped_swiglu, alpha=a.swiglu_alpha, limit=a.swiglu_limit)

        def block(i: int) -> DecoderBlock:
            mixer = SparseAttention(attn, a) if a.layer_types[i] == "minimax_m3_sparse" else Attention(attn)
            if a.mlp_layer_types[i] == "dense":
                mlp = ClampedMLP(a.hidden_size, a.dense_intermediate_size, a.swiglu_alpha, a.swiglu_limit)
            else:
                gate = GroupLimitedRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, 1, 1, True,
                                          a.routed_scaling_factor)
                experts = SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_local_experts, act=act,
                                    native_act=(native.ACT_CLAMPED, a.swiglu_alpha, a.swiglu_limit))
                mlp = SparseMoE(gate, experts, ClampedMLP(a.hidden_size, a.shared_intermediate_size, a.swiglu_alpha,
                                                          a.swiglu_limit), shared_name="shared_experts")
            return DecoderBlock(mixer, mlp, a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse MiniMax-M3 configs this file does not implement (module docstring)."""
    check_act_and_rope(NAME, cfg, act=False)  # (the release says "swigluoai": the clamped SwiGLU, always)
    a = ModelArgs.from_dict(cfg)
    n = a.num_hidden_layers
    for key, kinds, got in (("layer_types", KINDS, a.layer_types), ("mlp_layer_types", MLP_KINDS, a.mlp_layer_types)):
        if len(got) != n or any(k not in kinds for k in got):
            refuse(NAME, key, got, f"{n} entries of {' / '.join(kinds)}")
    if "minimax_m3_sparse" in a.layer_types:
        if a.index_n_heads != a.num_key_value_heads:
            refuse(NAME, "index_n_heads", a.index_n_heads,
                   f"one selection a KV group: num_key_value_heads={a.num_key_value_heads}")
        if a.index_head_dim < a.rotary_dim:
            refuse(NAME, "index_head_dim", a.index_head_dim, f"at least rotary_dim={a.rotary_dim}")
        for key in ("index_block_size", "index_topk_blocks", "index_local_blocks"):
            v = getattr(a, key)
            if v < (0 if key == "index_local_blocks" else 1):
                refuse(NAME, key, v, "a positive integer")
    if not 0 < a.rotary_dim <= a.head_dim or a.rotary_dim % 2:
        refuse(NAME, "rotary_dim", a.rotary_dim, f"an even number of channels up to head_dim={a.head_dim}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        refuse(NAME, "attention_bias", True, "no biases, as released")


# the zero-centred norms (applied as 1 + w): every RMSNorm of the text model
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
_OTHER = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
          "patch_merge_mlp.")
# the release's names -> transformers' (its conversion mapping for minimax_m3_vl): the MoE block is
# `block_sparse_moe` (per-expert w1 / w3 / w2: the converter's per-expert layout), the indexer's weights `index_*`
_RELEASE = ((".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
            (".block_sparse_moe.", ".mlp."),
            (".self_attn.index_q_proj.", ".self_attn.indexer.q_proj."),
            (".self_attn.index_k_proj.", ".self_attn.indexer.k_proj."),
            (".self_attn.index_q_norm.", ".self_attn.indexer.q_norm."),
            (".self_attn.index_k_norm.", ".self_attn.indexer.k_norm."))


MTP = re.compile(r"model\.mtp\.layers\.(\d+)\.(.+)")  # (DeepSeek's names, its layer under `transformer_layer.`)
MTP_NORM = re.compile(r"mtp\.\d+\.(enorm|hnorm|norm)\.weight")  # (the MTP module's own norms: zero-centred too)


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the multimodal release's text model moves up (`language_model.model.` as released,
    `model.language_model.` as transformers saves it), its MTP modules to `mtp.{j}.`; its vision tower and
    projectors go."""
    if name.startswith(_OTHER):
        return None
    if name.startswith("language_model."):
        name = name.removeprefix("language_model.")  # (language_model.model.X -> model.X, .lm_head -> lm_head)
    name = text_model_name(name)
    if name is not None and (m := MTP.fullmatch(name)):
        name = mtp.canonical(m[2].removeprefix("transformer_layer."), int(m[1]))
    elif name is not None and (name.startswith("mtp.") or ".mtp." in name):
        return None
    return None if name is None else rename_first(name, _RELEASE)


def mtp_config(cfg: dict) -> dict:
    """The MTP module's layer (sparse attention, MoE: vLLM forces both) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "layer_types": ["minimax_m3_sparse"], "mlp_layer_types": ["sparse"]}


def source_view(st, cfg: dict):
    """Each dense MLP's and shared expert's gate_up_proj [2I, H] as its gate rows and its up rows."""
    split = {}
    for n in st.names():
        if n.endswith(("mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight")):
            rows = st.shape(n)[0]
            split[n.replace(".gate_up_proj.", ".gate_proj.")] = (n, 0, rows // 2)
            split[n.replace(".gate_up_proj.", ".up_proj.")] = (n, rows // 2, rows)
    return SplitRows(st, split)


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The zero-centred norms' weights as applied (1 + w, in f32)."""
    if name == "model.norm.weight" or name.endswith(ZERO_CENTRED) or MTP_NORM.fullmatch(name):
        return 1.0 + t.float()
    return t


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize,
                prepare=prepare, mtp_config=mtp_config)
