"""poolside's Laguna (`laguna`: laguna-XS.2): AFMoE-style attention with a softplus output gate over GLM's MoE layers.

- Attention: per-head q/k RMSNorm before RoPE, each layer its own head count (`num_attention_heads_per_layer`);
  `layer_types` sliding layers attend over `sliding_window` positions; each type its own RoPE base and rotated
  share (`rope_parameters` keyed by type; without it transformers' defaults: full layers 500000 over half the
  head, sliding ones 10000 over all of it). The heads' outputs are multiplied by softplus(g_proj(x)) before
  o_proj: one gate a head (`gating` true / "per-head") or one a channel ("per-element").
- MoE: sigmoid scores (the logits optionally soft-capped by tanh first), the top k by score + a selection-only
  correction bias, renormalised, times `moe_routed_scaling_factor`, beside a shared expert; dense layers where
  `mlp_layer_types` says so (default: layer 0).

The kernels' attention block takes the gate (kernels/block.c: the gate projection beside q/k/v, its softplus after
the heads); without soft-capping the MoE layers' router is the kernels' sigmoid rule (GLM's), so a decode step runs
in one native call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import native, native_block
from ..layers.attention import Attention, AttentionArgs, OutGate, Output, Positions, QKNorm, Scores
from ..layers.layers import MLP, DecoderBlock, Linear
from ..layers.moe import SparseMoE, SwitchGLU
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family
from .glm4_moe import GroupLimitedRouter

NAME = "laguna"
KINDS = ("full_attention", "sliding_attention")
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    sliding_window: int | None = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    gating: bool | str = True
    num_attention_heads_per_layer: list | None = None
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    moe_routed_scaling_factor: float = 1.0
    moe_router_logit_softcapping: float = 0.0
    raw: dict | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        self.layer_types = self.layer_types or ["full_attention"] * n
        self.mlp_layer_types = self.mlp_layer_types or ["dense"] + ["sparse"] * (n - 1)
        self.num_attention_heads_per_layer = self.num_attention_heads_per_layer or [self.num_attention_heads] * n

    def rope(self, kind: str) -> dict:
        params = (self.raw or {}).get("rope_parameters") or ROPE_DEFAULTS
        return params[kind]


class GatedAttention(Attention):
    """Attention whose heads' outputs are scaled by softplus(g_proj(x)) before o_proj: one gate a head, or one a
    channel."""

    def __init__(self, a: AttentionArgs, per_head: bool):
        super().__init__(a)
        self.per_head = per_head
        self.g_proj = Linear(a.hidden, a.heads if per_head else a.heads * a.head_dim)

    def out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = self.g_proj(x)  # [T, heads] or [T, heads * D]
        if o.dtype == torch.bfloat16 and o.device.type == "cpu" and native.available():
            return super().out(native.gate_mul(o, g, self.a.heads), x)  # (the fused block's arithmetic: its bits)
        gate = F.softplus(g.float()).to(o.dtype)
        if self.per_head:
            o = (o.view(o.shape[0], -1, self.a.head_dim) * gate.unsqueeze(-1)).view(o.shape)
        else:
            o = o * gate
        return super().out(o, x)

    def fused(self, h: torch.Tensor, kv, in_norm, post_norm):
        """Attention.fused: kernels/block.c with the gate projection and its softplus (`_build_native_layer`)."""
        return super().fused(h, kv, in_norm, post_norm)

    def _build_native_layer(self, in_norm, post_norm):
        layer = super()._build_native_layer(in_norm, post_norm)
        g, q = self.g_proj, self.q_proj
        if layer is None or getattr(g, "path", None) != "native" or g.bias is not None \
                or (g.scheme, g.group_size) != (q.scheme, q.group_size):
            return None
        kind = OutGate.HEAD_SOFTPLUS if self.per_head else OutGate.CHANNEL_SOFTPLUS
        layer.gate = native_block.ref(native_block.AttnGate(kind, native.QW(*native.qw(g))))
        return layer


class Router(GroupLimitedRouter):
    """GLM's sigmoid router with one group and a scale, the logits optionally soft-capped (tanh) first."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, scale: float, softcap: float):
        super().__init__(hidden, num_experts, top_k, 1, 1, True, scale)
        self.softcap = softcap

    def native_routing(self):
        return None if self.softcap > 0 else super().native_routing()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.softcap > 0:
            return super().forward(x)
        logits = x.float() @ self.weight.float().T  # [T, E]
        scores = torch.sigmoid(torch.tanh(logits / self.softcap) * self.softcap)  # [T, E]
        idx = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, idx)
        return idx, weights / weights.sum(-1, keepdim=True) * self.scale


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        per_head = a.gating is True or a.gating == "per-head"

        def block(i: int) -> DecoderBlock:
            kind = a.layer_types[i]  # type: ignore[index]
            r = a.rope(kind)
            rotary = int(a.head_dim * r.get("partial_rotary_factor", 1.0))
            window = a.sliding_window if kind == "sliding_attention" else None
            attn = GatedAttention(AttentionArgs(
                a.hidden_size, a.num_attention_heads_per_layer[i], a.num_key_value_heads, a.head_dim,  # type: ignore[index]
                Positions(float(r["rope_theta"]), None, a.max_position_embeddings, rotary_dim=rotary),
                bias=a.attention_bias, qk_norm=QKNorm.HEAD, norm_eps=a.rms_norm_eps,
                scores=Scores(sliding_window=window), output=Output(o_bias=a.attention_bias)), per_head)
            if a.mlp_layer_types[i] == "dense":  # type: ignore[index]
                return DecoderBlock(attn, MLP(a.hidden_size, a.intermediate_size), a.hidden_size, a.rms_norm_eps)
            gate = Router(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.moe_routed_scaling_factor,
                          a.moe_router_logit_softcapping)
            mlp = SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts),
                            MLP(a.hidden_size, a.shared_expert_intermediate_size), shared_name="shared_experts")
            return DecoderBlock(attn, mlp, a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Laguna configs this file does not implement."""
    check_act_and_rope(NAME, {k: v for k, v in cfg.items() if k != "rope_parameters"})
    n = int(cfg.get("num_hidden_layers") or 0)
    for field, allowed in (("layer_types", KINDS), ("mlp_layer_types", ("dense", "sparse"))):
        given = cfg.get(field)
        if given is not None and (not isinstance(given, list) or len(given) != n
                                  or any(k not in allowed for k in given)):
            refuse(NAME, field, given, f"{n} entries of {' / '.join(allowed)}")
    heads = cfg.get("num_attention_heads_per_layer")
    kv = int(cfg.get("num_key_value_heads") or 8)
    if heads is not None and (not isinstance(heads, list) or len(heads) != n
                              or any(not isinstance(h, int) or h < 1 or h % kv for h in heads)):
        refuse(NAME, "num_attention_heads_per_layer", heads, f"{n} multiples of num_key_value_heads={kv}")
    if cfg.get("gating", True) not in (True, "per-head", "per-element"):
        refuse(NAME, "gating", cfg["gating"], 'true, "per-head" or "per-element"')
    if cfg.get("moe_apply_router_weight_on_input"):
        refuse(NAME, "moe_apply_router_weight_on_input", True, "transformers does not implement it either")
    kinds = cfg.get("layer_types") or ["full_attention"] * n
    if "sliding_attention" in kinds and not cfg.get("sliding_window", 512):
        refuse(NAME, "sliding_window", cfg.get("sliding_window"), "a window of at least 1 for the sliding layers")
    params = cfg.get("rope_parameters") or ROPE_DEFAULTS
    D = int(cfg.get("head_dim") or 128)
    for kind in sorted(set(kinds)):
        r = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(r, dict) or not isinstance(r.get("rope_theta"), int | float):
            refuse(NAME, f"rope_parameters.{kind}", r, "a rope_theta for each layer type")
        if r.get("rope_type", "default") != "default":
            refuse(NAME, f"rope_parameters.{kind}.rope_type", r.get("rope_type"), "default")
        rot = int(D * r.get("partial_rotary_factor", 1.0))
        if rot < 2 or rot % 2:
            refuse(NAME, f"rope_parameters.{kind}.partial_rotary_factor", r.get("partial_rotary_factor"),
                   "an even number of rotated channels")


_RENAMES = ((".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
            (".mlp.shared_expert.", ".mlp.shared_experts."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the release keeps the router's correction bias with the experts and names its
    shared expert `shared_expert`."""
    return rename_first(name, _RENAMES)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
