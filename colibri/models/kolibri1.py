"""Aleph Alpha's Kolibri-1 (`kolibri1`): EXAONE-4's attention in GLM-4's sandwich of norms over MoE layers:

- Attention: per-head q/k RMSNorm before RoPE, no biases; `layer_types` sliding layers attend over the last
  `sliding_window` positions with RoPE, the full ones (default: every fifth) use no RoPE while a window is set.
- Norms: each sublayer's output is RMSNorm'd before the residual add (the release's `post_attn_norm` /
  `post_ffn_norm`, transformers' `post_self_attn_layernorm` / `post_mlp_layernorm`; `self_attn.out_norm` /
  `mlp.out_norm` here), beside the usual norms of its input.
- MoE in every layer: the top k of logit + `e_score_correction_bias` (the bias only chooses), weighted by the
  sigmoid of their logits, renormalised when `norm_topk_prob`; plus an always-on shared expert.

The kernels' attention block (with its output norm), their ROUTE_LOGIT_BIAS_SIGMOID rule (kernels/route.c) and the
MoE block with the shared expert and output norm run it, in the one-call step too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layers.attention import Attention, QKNorm
from ..layers.layers import MLP, DecoderBlock, RMSNorm
from ..layers.moe import BiasedLogitRouter, SparseMoE, SwitchGLU
from . import qwen3_moe
from .base import CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family

NAME = "kolibri1"
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    """Qwen3-MoE's fields with Kolibri-1's defaults, its shared expert and its layer pattern."""

    shared_expert_intermediate_size: int = 512
    sliding_window: int | None = 513
    layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = default_kinds(self.num_hidden_layers)


def default_kinds(n: int) -> list[str]:
    """transformers' Kolibri1Config pattern: every fifth layer full, the rest sliding."""
    return [KINDS[bool((i + 1) % 5)] for i in range(n)]


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        base = qwen3_moe.attention_args(a, False, QKNorm.HEAD)
        base = dataclasses.replace(base, output=dataclasses.replace(base.output, out_norm=True))

        def block(i: int) -> DecoderBlock:
            sliding = a.layer_types[i] == "sliding_attention"  # type: ignore[index]
            attn = dataclasses.replace(
                base, positions=dataclasses.replace(base.positions, use_rope=sliding or a.sliding_window is None),
                scores=dataclasses.replace(base.scores, sliding_window=a.sliding_window if sliding else None))
            gate = BiasedLogitRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob)
            mlp = SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts),
                            MLP(a.hidden_size, a.shared_expert_intermediate_size), shared_name="shared_experts",
                            out_norm=RMSNorm(a.hidden_size, a.rms_norm_eps))
            return DecoderBlock(Attention(attn), mlp, a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Kolibri-1 configs this file does not implement: another activation or RoPE scaling, layer lists that
    do not name one valid kind per layer, sliding layers without a window, no shared expert."""
    check_act_and_rope(NAME, cfg)
    n = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    if "sliding_attention" in (kinds or default_kinds(n or 0)) and not cfg.get("sliding_window", 513):
        refuse(NAME, "sliding_window", cfg.get("sliding_window"), "a window of at least 1 for the sliding layers")
    if not cfg.get("shared_expert_intermediate_size", 512):
        refuse(NAME, "shared_expert_intermediate_size", cfg["shared_expert_intermediate_size"],
               "Kolibri-1's layers add a shared expert")
    for field in ("mlp_only_layers", "decoder_sparse_step"):  # (transformers' Kolibri1Config has neither)
        if cfg.get(field) not in (None, [], 1):
            refuse(NAME, field, cfg[field], "every Kolibri-1 layer is sparse")


_RENAMES = ((".post_self_attn_layernorm.", ".self_attn.out_norm."), (".post_attn_norm.", ".self_attn.out_norm."),
            (".post_mlp_layernorm.", ".mlp.out_norm."), (".post_ffn_norm.", ".mlp.out_norm."),
            (".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: each sublayer's output norm (transformers' and the release's names) is the
    sublayer's `out_norm` here; the release's router bias sits under `moe.router`."""
    return rename_first(name, _RENAMES)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
