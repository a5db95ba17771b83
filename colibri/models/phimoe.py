"""Phi-3.5-MoE (`phimoe`): Mixtral's layers with these differences:

- LayerNorm (mean-centred, with a bias) where Mixtral has RMSNorm, the final norm too; q/k/v and o projections
  with biases (`attention_bias`), and an lm_head bias (`lm_head_bias`).
- The router is "sparsemixer" at inference: the first expert is the best logit, weighted by its softmax over
  the logits within a relative `2 * router_jitter_noise` of it; the second the best of the rest, weighted
  likewise over the rest within that distance of it. Always two experts, never renormalised. bf16 rows route
  in the kernels (kernels/route.c).
- RoPE is "longrope" with its short factors at every length and the `short_mscale` scale, as transformers'
  phimoe computes it (the released config has equal short and long scales; unequal ones are refused, since
  transformers switches the scale of a whole forward by its longest position).

At int8 / int4 on the CPU the kernels run all of it: the attention block and the one-call step's tail take the
LayerNorms (with their biases) and the lm_head's bias; bf16 rows route by the kernels' sparsemixer rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native
from ..layers.attention import AttentionArgs
from ..layers.layers import LayerNorm, Linear, rope_scaling
from ..layers.moe import RouteRule, native_route
from . import mixtral
from .base import check_act_and_rope, refuse
from .family import Family

NAME = "phimoe"


@dataclass
class ModelArgs(mixtral.ModelArgs):
    """Mixtral's fields with Phi's defaults and its own."""

    max_position_embeddings: int = 131072
    attention_bias: bool = False
    lm_head_bias: bool = False
    router_jitter_noise: float = 0.01


class SparsemixerRouter(nn.Module):
    """transformers' `sparsemixer` at inference, in f32: [T, H] -> (idx [T, 2], weights [T, 2])."""

    def __init__(self, hidden: int, num_experts: int, jitter_eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H]
        self.top_k, self.jitter_eps = 2, jitter_eps

    def native_routing(self) -> RouteRule:
        """The kernels' rule (kernels/route.c route_select_sparsemixer): bf16 rows route in one native call."""
        return RouteRule(native.ROUTE_SPARSEMIXER, False, None, self.jitter_eps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        scores = x.float() @ self.weight.float().T  # [T, E]
        w1, i1 = self._pick(scores, scores)
        rest = scores.scatter(-1, i1, float("-inf"))  # the first expert out of the running
        w2, i2 = self._pick(rest, scores)
        return torch.cat((i1, i2), -1), torch.cat((w1, w2), -1)

    def _pick(self, cand: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best of `cand` [T, E] and its softmax weight over the candidates within the relative jitter."""
        top, idx = cand.max(-1, keepdim=True)  # [T, 1]
        far = (top - scores) / scores.abs().clamp(min=top) > 2 * self.jitter_eps  # [T, E]
        gates = torch.softmax(cand.masked_fill(far, float("-inf")), -1)
        return gates.gather(-1, idx), idx


class Model(mixtral.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        for block in self.model.layers:
            block.input_layernorm = LayerNorm(a.hidden_size, a.rms_norm_eps)
            block.post_attention_layernorm = LayerNorm(a.hidden_size, a.rms_norm_eps)
        self.model.norm = LayerNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, bias=a.lm_head_bias)

    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        args = super().attention_args(a, i)
        return dataclasses.replace(args, bias=a.attention_bias,
                                   output=dataclasses.replace(args.output, o_bias=a.attention_bias))

    @classmethod
    def router(cls, a: ModelArgs) -> nn.Module:
        return SparsemixerRouter(a.hidden_size, a.num_local_experts, a.router_jitter_noise)


def check_config(cfg: dict) -> None:
    """Refuse Phi-MoE configs this file does not implement."""
    scaling = rope_scaling(cfg)
    longrope = scaling is not None and scaling["rope_type"] == "longrope"  # (this family's alone: see above)
    check_act_and_rope(NAME, {k: v for k, v in cfg.items()
                                if not (longrope and k in ("rope_scaling", "rope_parameters"))})
    if cfg.get("num_experts_per_tok", 2) != 2:
        refuse(NAME, "num_experts_per_tok", cfg["num_experts_per_tok"], "sparsemixer routes to exactly 2 experts")
    if longrope:
        short, long = scaling.get("short_mscale"), scaling.get("long_mscale")
        if short is None or short != long:
            refuse(NAME, "rope_scaling.short_mscale", short, f"equal to long_mscale ({long!r}), as released")
        if not isinstance(scaling.get("short_factor"), list):
            refuse(NAME, "rope_scaling.short_factor", scaling.get("short_factor"), "a list of numbers")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the released `block_sparse_moe` block and transformers' own `router` name."""
    return name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
