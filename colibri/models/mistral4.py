"""Mistral Small 4 (`mistral4`, Mistral-Small-4-119B): DeepSeek-V3's layers (deepseek_v3.py: MLA with its latent
cache, a shared expert, dense first layers) with Mistral's router and attention scaling:

- Router: softmax scores (no selection bias), the top k inside the `topk_group` best of `n_group` groups (a group
  scores the sum of its two best), renormalised (+ 1e-20) when `norm_topk_prob`, then times
  `routed_scaling_factor` (both, where DeepSeek-V2 does one or the other).
- Attention: q times 1 + beta log(1 + floor(pos / original_max_position_embeddings)) (Llama 4's long-context
  scaling, `rope_parameters.llama_4_scaling_beta`): exactly 1 below original_max_position_embeddings, where the
  native MLA block runs; rows past it take the torch path.
- Without `rope_parameters` the config means transformers' defaults: YaRN x128 over 8192 positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native
from ..layers.batch import LayerKV
from ..layers.mla import MLAttention
from ..layers.moe import RouteRule, native_route
from . import deepseek_v2 as v2
from . import deepseek_v3 as v3
from .base import refuse
from .deepseek_v2 import check_common
from .family import Family

NAME = "mistral4"


def rope_defaults(cfg: dict) -> dict:
    """transformers' Mistral4Config rope_parameters when a config has none."""
    nope, rope = int(cfg.get("qk_nope_head_dim", 64)), int(cfg.get("qk_rope_head_dim", 64))
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
            "max_position_embeddings": cfg.get("max_position_embeddings", 1048576), "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
            "partial_rotary_factor": rope / (nope + rope)}


@dataclass
class ModelArgs(v3.ModelArgs):
    aliases = {"num_local_experts": "n_routed_experts"}

    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    norm_topk_prob: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        if d.get("rope_parameters") is None and d.get("rope_scaling") is None:
            d = {**d, "rope_parameters": rope_defaults(d)}
        return super().from_dict(d)

    def scaling(self) -> tuple[float, int] | None:
        """(beta, original_max_position_embeddings) of the query scaling, or None."""
        p = (self.raw or {}).get("rope_parameters") or {}
        beta, orig = p.get("llama_4_scaling_beta"), p.get("original_max_position_embeddings")
        return (float(beta), int(orig)) if beta and orig else None


class Router(nn.Module):
    """Softmax scores, group-limited top-k, renormalised and scaled: `x [T, H] -> (idx [T, k], weights [T, k])`."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        E = a.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, a.hidden_size), requires_grad=False)  # [E, H]
        self.top_k, self.n_group, self.topk_group = a.num_experts_per_tok, a.n_group, a.topk_group
        self.scaling, self.norm_topk_prob = a.routed_scaling_factor, a.norm_topk_prob

    def native_routing(self) -> RouteRule | None:
        """The kernels' softmax rule (renormalised, or scaled) where it is this one: one group, and no scale
        on renormalised weights."""
        if self.n_group != 1 or (self.norm_topk_prob and self.scaling != 1.0):
            return None
        return RouteRule(native.ROUTE_SOFTMAX, self.norm_topk_prob and self.top_k > 1, None, float(self.scaling))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        scores = torch.softmax(x.float() @ self.weight.float().T, dim=-1)  # [T, E]
        T, E = scores.shape
        per = E // self.n_group
        best = scores.view(T, self.n_group, per).topk(2, -1).values.sum(-1)  # [T, G]: a group's two best
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(self.topk_group, -1).indices, True)
        choice = scores.masked_fill(~keep.repeat_interleave(per, 1), 0.0)  # [T, E]
        idx = choice.topk(self.top_k, -1).indices  # [T, k]
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling


class Mistral4Attention(MLAttention):
    """MLA whose queries are scaled past original_max_position_embeddings (module docstring)."""

    def __init__(self, mla, scaling: tuple[float, int] | None):
        super().__init__(mla)
        self.scaling = scaling

    def q_scale(self, kv: LayerKV, T: int) -> torch.Tensor | None:
        if self.scaling is None or kv.end <= self.scaling[1]:
            return None  # (every row below original_max_position_embeddings: a scale of exactly 1)
        beta, orig = self.scaling
        pos = torch.arange(kv.pos, kv.pos + T) if isinstance(kv.pos, int) else kv.pos
        return 1 + beta * torch.log(1 + torch.floor(pos.to(torch.float32) / orig))


    def pos_limit(self) -> int:
        """Positions below this have a scale of 1, which the native block computes (native_step reads it)."""
        return self.scaling[1] if self.scaling is not None else 1 << 62

    def fused(self, h, kv: LayerKV, in_norm, post_norm):
        return None if kv.end > self.pos_limit() else super().fused(h, kv, in_norm, post_norm)


class Model(v2.Model):
    router_cls = Router

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        mla, scaling = a.mla(), a.scaling()
        for b in self.model.layers:  # the attention with its query scaling, the same weights' names
            b.self_attn = Mistral4Attention(mla, scaling)


def check_config(cfg: dict) -> None:
    a = {**cfg}
    if a.get("rope_parameters") is None and a.get("rope_scaling") is None:
        a["rope_parameters"] = rope_defaults(a)
    check_common(a)
    experts, groups = int(a.get("n_routed_experts") or a.get("num_local_experts") or 128), int(a.get("n_group") or 1)
    if experts % groups or experts // groups < 2:
        refuse(NAME, "n_group", groups, f"must split the {experts} experts into groups of >= 2")
    beta = (a.get("rope_parameters") or {}).get("llama_4_scaling_beta")
    if beta is not None and (not isinstance(beta, int | float) or not math.isfinite(beta)):
        refuse(NAME, "rope_parameters.llama_4_scaling_beta", beta, "a finite number")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config)
