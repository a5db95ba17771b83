"""IBM Granite 3.x MoE (`granitemoe`: granite-3.1-1b-a400m, granite-3.1-3b-a800m): Mixtral's layers with a router
that takes the top-k logits and softmaxes over those k, and Granite's four multipliers, each put where the
kernels already have a place for it (equal to transformers' order of operations up to float rounding):

- `embedding_multiplier`: the embedding table is stored times it (`prepare`);
- `attention_multiplier`: the attention's score scale, instead of 1 / sqrt(head_dim);
- `residual_multiplier`: o_proj is stored times it (`prepare`), and the routed experts' weights are times it
  (the router's scale), so each block adds multiplier x its output to the residual;
- `logits_scaling`: lm_head is stored divided by it (`prepare`; a tied head is its own tensor in the container).

Released checkpoints keep the experts fused (`block_sparse_moe.input_linear` [E, 2I, H]: gate rows, then up;
`output_linear` [E, H, I]) and the router as `block_sparse_moe.router.layer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import AttentionArgs
from ..layers.layers import rope_theta
from ..layers.moe import SoftmaxTopKRouter
from . import mixtral
from .base import check_act_and_rope, refuse, rename_first
from .family import Family

NAME = "granitemoe"


@dataclass
class ModelArgs(mixtral.ModelArgs):
    """Mixtral's fields with Granite's defaults and multipliers (head_dim: hidden / heads, check_config's rule)."""

    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0


class Model(mixtral.Model):
    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        args = super().attention_args(a, i)
        return dataclasses.replace(
            args, positions=dataclasses.replace(args.positions, rope_theta=rope_theta(a.raw or {}, 10000.0)),
            bias=a.attention_bias, scores=dataclasses.replace(args.scores, scale=a.attention_multiplier),
            output=dataclasses.replace(args.output, o_bias=a.attention_bias))

    @classmethod
    def router(cls, a: ModelArgs) -> nn.Module:
        # (its top-k softmax, times the residual multiplier: gpt-oss's rule with no bias)
        return SoftmaxTopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, bias=False,
                                 scale=a.residual_multiplier)


def check_config(cfg: dict) -> None:
    """Refuse Granite MoE configs this file does not implement."""
    check_act_and_rope(NAME, cfg)
    if cfg.get("head_dim") not in (None, cfg.get("hidden_size", 0) // max(cfg.get("num_attention_heads") or 1, 1)):
        refuse(NAME, "head_dim", cfg["head_dim"], "hidden_size / num_attention_heads, as transformers' Granite")
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        v = cfg.get(key, 1.0)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
            refuse(NAME, key, v, "a number > 0")


_RENAMES = ((".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
            (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
            (".block_sparse_moe.router.layer.", ".mlp.gate."), (".block_sparse_moe.router.", ".mlp.gate."),
            (".block_sparse_moe.", ".mlp."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the released fused experts and router, and transformers' own names."""
    return rename_first(name, _RENAMES)


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Fold the multipliers that scale a stored tensor (see the module docstring), in f32."""
    factor = 1.0
    if name == "model.embed_tokens.weight":
        factor = float(cfg.get("embedding_multiplier") or 1.0)
    elif name == "lm_head.weight":
        factor = 1.0 / float(cfg.get("logits_scaling") or 1.0)
    elif name.endswith(".self_attn.o_proj.weight") or name.endswith(".self_attn.o_proj.bias"):
        factor = float(cfg.get("residual_multiplier") or 1.0)
    return t if factor == 1.0 else (t.float() * factor).to(t.dtype)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, prepare=prepare)
