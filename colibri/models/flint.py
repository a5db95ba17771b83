"""Recursive's Flint (`flint`): Qwen3-MoE's layers (per-head q/k RMSNorm, dense layers where `mlp_only_layers` /
`decoder_sparse_step` say so) with gpt-oss-like attention and a sigmoid router:

- Attention: `layer_types` sliding layers attend over the last `sliding_window` positions with RoPE; the full
  layers use no positional encoding at all; a learned per-head sink logit joins every layer's softmax denominator
  (`self_attn.sinks`; the release's `self_attn.softmax_offset`).
- MoE: sigmoid scores, the top k chosen by score (no correction bias), renormalised when `norm_topk_prob`, plus an
  ungated shared expert of `shared_expert_intermediate_size`.

The attention block (sinks, windows, NoPE), the kernels' sigmoid router (a zero selection bias) and the MoE block
with its shared expert run it, in the one-call step too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layers.attention import Attention, QKNorm
from ..layers.layers import MLP, DecoderBlock
from ..layers.moe import SparseMoE, SwitchGLU
from . import qwen3_moe
from .base import CausalLM, check_act_and_rope, refuse
from .family import Family
from .glm4_moe import GroupLimitedRouter

NAME = "flint"
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    """Qwen3-MoE's fields with Flint's defaults, its shared expert and its layer pattern."""

    shared_expert_intermediate_size: int = 1024
    sliding_window: int | None = 513
    norm_topk_prob: bool = True
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = default_kinds(self.num_hidden_layers)
        if (self.raw or {}).get("mlp_only_layers") is None:  # (transformers' FlintConfig: layers 0 and 1 dense)
            self.mlp_only_layers = [0, 1]


def default_kinds(n: int) -> list[str]:
    """transformers' FlintConfig pattern: layers 0, 1, every 4th from 1 and the last full, the rest sliding."""
    return [KINDS[not (i < 2 or i % 4 == 1 or i == n - 1)] for i in range(n)]


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        base = qwen3_moe.attention_args(a, False, QKNorm.HEAD)

        def attn(i: int) -> Attention:
            sliding = a.layer_types[i] == "sliding_attention"  # type: ignore[index]
            window = a.sliding_window if sliding else None
            return Attention(dataclasses.replace(
                base, positions=dataclasses.replace(base.positions, use_rope=sliding),
                scores=dataclasses.replace(base.scores, sliding_window=window, sinks=True)))

        def mlp(i: int):
            if not a.is_sparse(i):
                return MLP(a.hidden_size, a.intermediate_size)
            gate = GroupLimitedRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, 1, 1, a.norm_topk_prob, 1.0,
                                      bias=False)  # (sigmoid scores, the top k by score: no correction bias)
            return SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts),
                             MLP(a.hidden_size, a.shared_expert_intermediate_size))

        blocks = [DecoderBlock(attn(i), mlp(i), a.hidden_size, a.rms_norm_eps) for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Flint configs this file does not implement: another activation or RoPE scaling, attention biases,
    layer lists that do not name one valid kind per layer, sliding layers without a window."""
    check_act_and_rope(NAME, cfg)
    n = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    if "sliding_attention" in (kinds or default_kinds(n or 0)) and not cfg.get("sliding_window", 513):
        refuse(NAME, "sliding_window", cfg.get("sliding_window"), "a window of at least 1 for the sliding layers")
    for field in ("attention_bias", "qkv_bias"):
        if cfg.get(field):
            refuse(NAME, field, True, "Flint's projections have no biases")
    if not cfg.get("shared_expert_intermediate_size", 1024):
        refuse(NAME, "shared_expert_intermediate_size", cfg["shared_expert_intermediate_size"],
               "Flint's sparse layers add a shared expert")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the release's sink logits are `self_attn.softmax_offset`."""
    return name.replace(".self_attn.softmax_offset", ".self_attn.sinks")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
