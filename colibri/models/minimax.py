"""MiniMax-Text-01 / MiniMax-M1 (`minimax`: the transformers port of the 456B-A45.9B models): lightning-attention
layers (lightning.py: linear attention with a per-head decay, a fixed state) and softmax-attention layers (GQA, RoPE
over the whole head) by `layer_types`, each over Mixtral's experts (softmax top-k, renormalised).

Each layer keeps the *normed* stream as its residual, weighted (transformers' MiniMaxDecoderLayer):

    x = n1(h); h = alpha_a x + beta_a attn(x); x = n2(h); h = alpha_m x + beta_m moe(x)

with (alpha_a, beta_a) = `linear_attn_alpha_factor` / `_beta_factor` or `full_attn_...` by the layer's kind, and
(alpha_m, beta_m) = `mlp_alpha_factor` / `mlp_beta_factor`. The lightning layers' states keep prompt caching off.
The decay tables transformers saves as buffers (`slope_rate`, `query_decay`, `key_decay`, `diagonal_decay`) are
dropped at conversion: they follow from the config and are rebuilt. The blocks run layer by layer: a lightning layer's
bf16 decode rows in kernels/lightning.c (the input norm to the post norm in one call), the experts in kernels/moe.c
(the whole MoE block in one call where `mlp_beta_factor` is 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import Attention, AttentionArgs, Positions
from ..layers.batch import LayerKV
from ..layers.layers import RMSNorm, rope_scaling, rope_theta
from ..layers.lightning import LightningArgs, LightningAttention
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from . import mixtral
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family

NAME = "minimax"
KINDS = ("linear_attention", "full_attention")
DEFAULT_THETA = 1e6  # transformers' MiniMaxConfig.default_theta
# transformers saves the lightning layers' decay tables; the model rebuilds them from the config
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)")
sanitize = mixtral.sanitize  # (Mixtral's names: `block_sparse_moe` is the MoE block)


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int = 32000
    intermediate_size: int = 14336
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    block_size: int = 256
    layer_types: list | None = None
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def kind(self, i: int) -> str:
        return layer_types(self.layer_types, self.num_hidden_layers)[i]


def layer_types(given: list | None, n_layers: int) -> list[str]:
    """Per layer "linear_attention" or "full_attention", as transformers' MiniMaxConfig decides without a list."""
    return list(given) if given is not None else ["full_attention" if (i + 1) % 2 else "linear_attention"
                                                  for i in range(n_layers)]


class Block(nn.Module):
    """One MiniMax layer (the module docstring's weighted residuals over the normed stream)."""

    routed = True

    def __init__(self, attn: nn.Module, mlp: SparseMoE, hidden: int, eps: float, attn_w: tuple[float, float],
                 mlp_w: tuple[float, float]):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        (self.alpha, self.beta), (self.mlp_alpha, self.mlp_beta) = attn_w, mlp_w

    def forward(self, h: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        fused = getattr(self.self_attn, "fused", None) if isinstance(self.self_attn, LightningAttention) else None
        out = None if fused is None else fused(h, kv, self.input_layernorm, self.post_attention_layernorm,
                                               self.alpha, self.beta)
        if out is not None:  # (the lightning layers' decode rows: kernels/lightning.c)
            h, x = out
        else:
            x = self.input_layernorm(h)
            h = x * self.alpha + self.self_attn(x, kv) * self.beta
            x = self.post_attention_layernorm(h)
        if self.mlp_beta == 1.0:  # alpha x + moe(x): the kernels' MoE block with alpha x as its residual
            out = self.mlp.fused(x, x * self.mlp_alpha)
            if out is not None:
                return out
        return x * self.mlp_alpha + self.mlp(x, h) * self.mlp_beta  # (h: the look-ahead's residual)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        blocks = []
        for i in range(a.num_hidden_layers):
            if a.kind(i) == "linear_attention":
                attn = LightningAttention(LightningArgs(a.hidden_size, a.num_attention_heads, a.head_dim,
                                                        a.block_size, i, a.num_hidden_layers))
                w = (a.linear_attn_alpha_factor, a.linear_attn_beta_factor)
            else:
                raw = a.raw or {}
                attn = Attention(AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                               Positions(rope_theta(raw, DEFAULT_THETA), rope_scaling(raw),
                                                         a.max_position_embeddings), norm_eps=a.rms_norm_eps))
                w = (a.full_attn_alpha_factor, a.full_attn_beta_factor)
            moe = SparseMoE(TopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, True),
                            SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_local_experts))
            blocks.append(Block(attn, moe, a.hidden_size, a.rms_norm_eps, w, (a.mlp_alpha_factor, a.mlp_beta_factor)))
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse MiniMax configs this file does not implement (transformers' port is the reference)."""
    check_act_and_rope(NAME, cfg)
    n = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    if cfg.get("sliding_window") is not None:
        refuse(NAME, "sliding_window", cfg["sliding_window"], "null: full attention layers attend to everything")
    if not isinstance(cfg.get("block_size", 256), int) or cfg.get("block_size", 256) < 1:
        refuse(NAME, "block_size", cfg.get("block_size"), "a positive number of positions")
    for key in ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor",
                "linear_attn_beta_factor", "mlp_alpha_factor", "mlp_beta_factor"):
        v = cfg.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int | float):
            refuse(NAME, key, v, "a number")
    # The original MiniMax-Text-01 config's fields transformers does not read: a checkpoint that sets them
    # otherwise than the port assumes would not run as transformers runs it
    if cfg.get("postnorm") is False:
        refuse(NAME, "postnorm", False, "true: the port keeps the normed stream as the residual")
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(cfg.get("num_attention_heads") or 1, 1)
    if cfg.get("rotary_dim") not in (None, head_dim):
        refuse(NAME, "rotary_dim", cfg["rotary_dim"], f"head_dim ({head_dim}): the port rotates whole heads")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, ignored=IGNORED)
