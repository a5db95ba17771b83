"""Qwen3-Next (`qwen3_next`, Qwen3-Next-80B-A3B): three Gated DeltaNet layers (linear attention,
linear_attn.py) for every full-attention one, under Qwen2-MoE's experts (softmax top-k of 512, a shared
expert behind a sigmoid gate).

- Full attention: q_proj gives each head's query and an output gate side by side ([H, 2D]); q/k RMSNorm per
  head before RoPE, which turns `partial_rotary_factor` (0.25) of each head; the output times sigmoid(gate)
  goes to o_proj.
- The RMSNorms (layers', final, q/k) are zero-centred: weight 1 + w. The converter stores 1 + w (in f32,
  exactly what transformers computes), so the layers are plain RMSNorms (`prepare`); the DeltaNet's gated
  norm is not zero-centred and stays as it is.
- The linear-attention layers' state replaces their KV cache; the engine runs no prompt caching for such
  models (linear_attn.py). Decode takes the per-layer path (the fused native blocks do not cover these
  layers); the projections and experts run the quantized kernels as in every family.
- The multi-token-prediction layer (`mtp.*`: fc, pre_fc_norm_embedding / _hidden, one gated full-attention MoE
  layer, norm; `mtp_num_hidden_layers`) is kept (layers/mtp.py `qwen_canonical`, `mtp_config`; its norms
  zero-centred as the others).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import native, native_block
from ..layers import mtp
from ..layers.attention import Attention, AttentionArgs, OutGate, Positions, QKNorm, attend
from ..layers.batch import LayerKV
from ..layers.layers import DecoderBlock, Linear, rope_scaling, rope_theta
from ..layers.linear_attn import DeltaArgs, GatedDeltaNet, grouped_rows
from . import qwen2_moe
from .base import CausalLM, check_act_and_rope, refuse
from .family import Family
from .qwen3_moe import ModelArgs as _Qwen3Args

NAME = "qwen3_next"
KINDS = ("linear_attention", "full_attention")


@dataclass
class ModelArgs(_Qwen3Args):
    split_projections: ClassVar[bool] = False  # the linear layers' four input projections (Qwen3.5's)

    head_dim: int | None = 256
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 512
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None

    def kinds(self) -> list[str]:
        return layer_kinds(self.raw or {}, self.num_hidden_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * partial_rotary_factor(self.raw or {}))  # type: ignore[operator]


def partial_rotary_factor(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))


def layer_kinds(cfg: dict, n: int) -> list[str]:
    """transformers' rule: `layer_types`, else every fourth layer full attention."""
    given = cfg.get("layer_types")
    return list(given) if given is not None else \
        ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]


class GatedAttention(Attention):
    """Attention whose q_proj also yields a per-channel output gate (module docstring)."""

    def __init__(self, a: AttentionArgs):
        super().__init__(a)
        self.q_proj = Linear(a.hidden, a.heads * a.head_dim * 2, a.bias)

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        a, T = self.a, x.shape[0]
        q, gate = self.q_proj(x).view(T, a.heads, 2 * a.head_dim).split(a.head_dim, -1)  # [T, H, D] x2
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(T, a.kv_heads, a.head_dim))
        v = self.v_proj(x).view(T, a.kv_heads, a.head_dim)
        if a.positions.use_rope:  # (AFMoE's full layers have none)
            q, k = self.rope(q, kv.pos), self.rope(k, kv.pos)
        q = self.scaled_queries(q, kv)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D], [Hkv, T, D] x2
        outs = []
        for r0, r1, start, cache in kv.segs:
            k_all, v_all = cache.update(k[:, r0:r1], v[:, r0:r1], start)
            outs.append(attend(q[:, r0:r1], k_all, v_all, start, self.scale, a.scores.sliding_window))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H*D]
        gate = self.gate_logits(gate.reshape(T, -1))
        if o.dtype == torch.bfloat16 and o.device.type == "cpu" and native.available():
            return self.out(native.gate_mul(o, gate), x)  # (the fused block's arithmetic: the same bits)
        return self.out(o * torch.sigmoid(gate), x)

    def scaled_queries(self, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        """q [T, H, D] after the rotary, as the scores read it (Beam scales its NoPE layers' queries)."""
        return q

    def gate_logits(self, gate: torch.Tensor) -> torch.Tensor:
        """The output gate [T, H·D] before its sigmoid (Beam adds a bias)."""
        return gate

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention.fused: kernels/block.c, with its output gate (`_build_native_layer`)."""
        return super().fused(h, kv, in_norm, post_norm)

    def _build_native_layer(self, in_norm, post_norm):
        layer = super()._build_native_layer(in_norm, post_norm)
        if layer is not None:
            layer.gate = native_block.ref(native_block.AttnGate(OutGate.Q_SIGMOID))
        return layer


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw), rope_scaling(raw), a.max_position_embeddings,
                                       rotary_dim=a.rotary_dim), bias=a.attention_bias, qk_norm=QKNorm.HEAD,
                             norm_eps=a.rms_norm_eps)
        delta = DeltaArgs(a.hidden_size, a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                          a.linear_value_head_dim, a.linear_conv_kernel_dim, a.rms_norm_eps, a.split_projections)

        mixer = [GatedAttention(attn) if kind == "full_attention" else GatedDeltaNet(delta) for kind in a.kinds()]
        blocks = [DecoderBlock(m, qwen2_moe.mlp(a, i), a.hidden_size, a.rms_norm_eps) for i, m in enumerate(mixer)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict, family: str = NAME) -> None:
    """(`family`: the name the errors give, for Qwen3.5's models built on this one)"""
    check_act_and_rope(family, cfg)
    n = int(cfg.get("num_hidden_layers") or 0)
    kinds = layer_kinds(cfg, n)
    if len(kinds) != n or any(k not in KINDS for k in kinds):
        refuse(family, "layer_types", cfg.get("layer_types"), "linear_attention / full_attention, one per layer")
    kh, vh = cfg.get("linear_num_key_heads", 16), cfg.get("linear_num_value_heads", 32)
    if not isinstance(kh, int) or not isinstance(vh, int) or kh < 1 or vh % kh:
        refuse(family, "linear_num_value_heads", vh, f"a multiple of linear_num_key_heads={kh}")
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim"):
        v = cfg.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 16:
            refuse(family, key, v, "a positive integer")
    head = cfg.get("head_dim") or 256
    if int(head * partial_rotary_factor(cfg)) % 2:
        refuse(family, "partial_rotary_factor", partial_rotary_factor(cfg), "an even number of rotated channels")


# RMSNorms whose weight is stored as w but applied as 1 + w (module docstring)
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the linear layers' mixer sits under `self_attn` as every layer's does."""
    if name.startswith("mtp."):
        name = mtp.qwen_canonical(name.removeprefix("mtp."))
    return None if name is None else name.replace(".linear_attn.", ".self_attn.")


MTP_NORM = re.compile(r"mtp\.\d+\.(enorm|hnorm|norm)\.weight")  # (the MTP layer's own norms: zero-centred too)


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (gated full attention, routed experts) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "layer_types": ["full_attention"], "mlp_only_layers": [],
            "decoder_sparse_step": 1}


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The zero-centred norms' weights as applied (1 + w, in f32); the linear layers' input projections in
    GatedDeltaNet's row order (linear_attn.grouped_rows)."""
    if name == "model.norm.weight" or name.endswith(ZERO_CENTRED) or MTP_NORM.fullmatch(name):
        return 1.0 + t.float()
    if name.endswith(("self_attn.in_proj_qkvz.weight", "self_attn.in_proj_ba.weight")):
        a = ModelArgs.from_dict(cfg)
        qkvz, ba = grouped_rows(a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
                                a.linear_value_head_dim)
        return t[qkvz if name.endswith("qkvz.weight") else ba]
    return t


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, prepare=prepare,
                mtp_config=mtp_config)
