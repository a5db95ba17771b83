"""Arcee's AFMoE (`afmoe`: Trinity Nano / Mini / Large). Llama-like layers with these differences:

- norms on both sides of each sublayer: h + norm(attn(norm(h))), then h + norm(mlp(norm(h))) (`SandwichBlock`;
  the released `post_attention_layernorm` is the attention output's norm, `pre_mlp_layernorm` the MLP input's);
- gated attention: the heads' output times sigmoid(gate_proj(x)) before o_proj; q/k RMSNorm per head;
- `layer_types`: sliding layers (RoPE, `sliding_window`) and full layers without RoPE (by default every
  `global_attn_every_n_layers`-th layer is full);
- the first `num_dense_layers` layers dense; the rest routed by sigmoid scores with a selection bias
  (`expert_bias`), renormalised, times `route_scale` (DeepSeek-V3's router with one group), beside a shared
  expert `num_shared_experts` experts wide;
- `mup_enabled`: the embedding times sqrt(hidden_size), stored so (`prepare`).

Its blocks run layer by layer: the projections, experts and router in the kernels (bf16 / int8 / int4 rows), the
norms, attention and residuals in torch ops. The fused attention and MoE blocks and the one-call step have no
place for the norms after each sublayer (native_step.one_call_shape takes plain DecoderBlocks only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from ..kernels import native
from ..validate import is_number
from . import deepseek_v3
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .batch import LayerKV
from .layers import MLP, Attention, AttentionArgs, DecoderBlock, Linear, RMSNorm, rope_scaling, rope_theta
from .moe import SparseMoE, SwitchGLU

FAMILY = "afmoe"
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 6144
    moe_intermediate_size: int = 1408
    num_dense_layers: int = 1
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_experts: int = 64
    num_experts_per_tok: int = 6
    num_shared_experts: int = 2
    route_scale: float = 1.0
    global_attn_every_n_layers: int = 4
    sliding_window: int = 1024
    layer_types: list | None = None
    mup_enabled: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 16384
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            n = self.global_attn_every_n_layers
            self.layer_types = [KINDS[bool((i + 1) % n)] for i in range(self.num_hidden_layers)]


class GatedAttention(Attention):
    """Attention whose heads' output is gated per channel by sigmoid(gate_proj(x)) before o_proj."""

    def __init__(self, a: AttentionArgs):
        super().__init__(a)
        self.gate_proj = Linear(a.hidden, a.heads * a.head_dim)

    def out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)  # [T, H*D]
        if o.dtype == torch.bfloat16 and o.device.type == "cpu" and native.available():
            return self.o_proj(native.gate_mul(o, gate))  # (torch's bf16 sigmoid and product: the same bits)
        return self.o_proj(o * torch.sigmoid(gate))


class SandwichBlock(DecoderBlock):
    """h + attn_out_norm(attn(input_layernorm(h))), then h + mlp_out_norm(mlp(post_attention_layernorm(h)))."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__(attn, mlp, hidden, eps)
        self.attn_out_norm = RMSNorm(hidden, eps)
        self.mlp_out_norm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        h = h + self.attn_out_norm(self.self_attn(self.input_layernorm(h), kv))
        x = self.post_attention_layernorm(h)
        # (routed experts also get the residual: their look-ahead predicts the next layer's routes from it)
        return h + self.mlp_out_norm(self.mlp(x, h) if self.routed else self.mlp(x))


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        base = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             rope_theta(raw, 10000.0), rope_scaling(raw), a.max_position_embeddings,
                             qk_norm="head", norm_eps=a.rms_norm_eps)
        router = SimpleNamespace(n_routed_experts=a.num_experts, hidden_size=a.hidden_size, n_group=1, topk_group=1,
                                 num_experts_per_tok=a.num_experts_per_tok, routed_scaling_factor=a.route_scale,
                                 norm_topk_prob=True)  # (DeepSeek-V3's router, one group)

        def block(i: int) -> SandwichBlock:
            sliding = a.layer_types[i] == "sliding_attention"
            attn = GatedAttention(dataclasses.replace(base, sliding_window=a.sliding_window if sliding else None,
                                                      use_rope=sliding))
            if i < a.num_dense_layers:
                mlp = MLP(a.hidden_size, a.intermediate_size)
            else:
                mlp = SparseMoE(deepseek_v3.Router(router),
                                SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts),
                                MLP(a.hidden_size, a.moe_intermediate_size * a.num_shared_experts),
                                shared_name="shared_experts")
            return SandwichBlock(attn, mlp, a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse AFMoE configs this file does not implement."""
    check_act_and_rope(FAMILY, cfg)
    n, kinds = cfg.get("num_hidden_layers"), cfg.get("layer_types")
    if kinds is not None and (len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(FAMILY, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    every = cfg.get("global_attn_every_n_layers", 4)
    if kinds is None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        refuse(FAMILY, "global_attn_every_n_layers", every, "an integer >= 1")
    if cfg.get("num_shared_experts", 2) in (0, None):
        refuse(FAMILY, "num_shared_experts", cfg.get("num_shared_experts"), "at least 1, as released")
    scale = cfg.get("route_scale", 1.0)
    if not is_number(scale) or scale <= 0:
        refuse(FAMILY, "route_scale", scale, "a number > 0")


_RENAMES = ((".post_attention_layernorm.", ".attn_out_norm."), (".pre_mlp_layernorm.", ".post_attention_layernorm."),
            (".post_mlp_layernorm.", ".mlp_out_norm."), (".mlp.router.gate.", ".mlp.gate."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name (each at most one rename: the released norms swap places with ours)."""
    for old, new in _RENAMES:
        if old in name:
            return name.replace(old, new)
    return name


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """muP: the embedding stored times sqrt(hidden_size) (a tied head is its own tensor, unscaled)."""
    if name == "model.embed_tokens.weight" and cfg.get("mup_enabled"):
        return (t.float() * math.sqrt(cfg["hidden_size"])).to(t.dtype)
    return t
