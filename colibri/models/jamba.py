"""AI21's Jamba (`jamba`: Jamba-v0.1, Jamba-1.5-Mini / -Large, Jamba 1.6 / 1.7): Mamba layers (mamba1.py, with
Jamba's RMSNorms of dt, B and C) and attention layers without positional encoding, under feed-forwards that are
Mixtral's experts or a dense SwiGLU MLP:

- layer i attends when i % `attn_layer_period` == `attn_layer_offset`, else it is a Mamba layer;
- its feed-forward is routed experts when i % `expert_layer_period` == `expert_layer_offset` (softmax over all
  experts, the top k kept as they are: not renormalised), else dense (`intermediate_size`, the experts' width too);
- pre-norm blocks (`input_layernorm`, `pre_ff_layernorm`), the final norm `final_layernorm`.

The Mamba layers' states replace their KV caches, so prompt caching stays off (linear_attn.py). A decode row's Mamba
convolution and scan step take kernels/mamba1.c; the attention, MLP and MoE blocks take the kernels layer by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layers.attention import Attention, AttentionArgs, Positions
from ..layers.layers import MLP, DecoderBlock
from ..layers.mamba1 import Mamba1Args, Mamba1Mixer
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family

NAME = "jamba"


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int = 65536
    intermediate_size: int = 14336
    num_key_value_heads: int = 8
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    num_experts_per_tok: int = 2
    num_experts: int = 16
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    attn_layer_period: int = 8
    attn_layer_offset: int = 4
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    def attends(self, i: int) -> bool:
        return i % self.attn_layer_period == self.attn_layer_offset

    def routed(self, i: int) -> bool:
        return self.num_experts > 1 and i % self.expert_layer_period == self.expert_layer_offset

    def mamba_args(self) -> Mamba1Args:
        H = self.hidden_size
        rank = math.ceil(H / 16) if self.mamba_dt_rank == "auto" else int(self.mamba_dt_rank)
        return Mamba1Args(H, self.mamba_expand * H, self.mamba_d_state, rank, self.mamba_d_conv, self.rms_norm_eps,
                          self.mamba_conv_bias, self.mamba_proj_bias)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        H = a.hidden_size
        attn = AttentionArgs(H, a.num_attention_heads, a.num_key_value_heads, H // a.num_attention_heads,
                             Positions(10000.0, max_pos=a.max_position_embeddings, use_rope=False),
                             norm_eps=a.rms_norm_eps)

        def block(i: int) -> DecoderBlock:
            mixer = Attention(attn) if a.attends(i) else Mamba1Mixer(a.mamba_args())
            ffn = SparseMoE(TopKRouter(H, a.num_experts, a.num_experts_per_tok, False),
                            SwitchGLU(i, H, a.intermediate_size, a.num_experts)) if a.routed(i) \
                else MLP(H, a.intermediate_size)
            return DecoderBlock(mixer, ffn, H, a.rms_norm_eps)

        super().__init__(a.vocab_size, H, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Jamba configs this file does not implement."""
    check_act_and_rope(NAME, cfg)
    n = cfg.get("num_hidden_layers", 32)
    for key, default in (("attn_layer_period", 8), ("attn_layer_offset", 4), ("expert_layer_period", 2),
                         ("expert_layer_offset", 1), ("mamba_d_state", 16), ("mamba_d_conv", 4), ("mamba_expand", 2)):
        v = cfg.get(key, default)
        low = 0 if key.endswith("offset") else 2 if key == "mamba_d_conv" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            refuse(NAME, key, v, f"an integer of at least {low}")
    for kind in ("attn", "expert"):
        if cfg.get(f"{kind}_layer_offset", 4 if kind == "attn" else 1) >= cfg.get(f"{kind}_layer_period",
                                                                                  8 if kind == "attn" else 2):
            refuse(NAME, f"{kind}_layer_offset", cfg[f"{kind}_layer_offset"], f"below {kind}_layer_period")
    experts, period = cfg.get("num_experts", 16), cfg.get("expert_layer_period", 2)
    if experts <= 1 or cfg.get("expert_layer_offset", 1) >= n:
        refuse(NAME, "num_experts", experts, f"at least 2, in at least one of the {n} layers (every {period})")
    rank = cfg.get("mamba_dt_rank", "auto")
    if rank != "auto" and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        refuse(NAME, "mamba_dt_rank", rank, '"auto" or a positive integer')
    heads = cfg.get("num_attention_heads") or 1
    if cfg.get("hidden_size", 0) % heads or heads % (cfg.get("num_key_value_heads") or heads):
        refuse(NAME, "num_attention_heads", heads, "a divisor of hidden_size, a multiple of num_key_value_heads")


_RENAMES = ((".mamba.", ".self_attn."), (".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
            (".pre_ff_layernorm.", ".post_attention_layernorm."), ("model.final_layernorm.", "model.norm."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: a Mamba layer's mixer under `self_attn` as attention's, the feed-forward under
    `mlp` (its router as `gate`), the norms under the decoder's names."""
    return rename_first(name, _RENAMES)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
