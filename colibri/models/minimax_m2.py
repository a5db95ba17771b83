"""MiniMax-M2 (230B, 10B active): Mixtral's layout (`block_sparse_moe`, experts w1/w2/w3, no shared expert,
no dense layer) with OLMoE's q/k RMSNorm over the whole projection, RoPE on the first `rotary_dim` channels
of each head, and a sigmoid router whose `e_score_correction_bias` only picks the experts (GLM's router with
one group; the mixing weights are the unbiased scores, renormalised)."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import Attention, AttentionArgs, Positions, QKNorm
from ..layers.layers import DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU
from . import mixtral
from .base import CausalLM, check_act_and_rope
from .base import refuse as _refuse
from .family import Family
from .glm4_moe import GroupLimitedRouter


@dataclass
class ModelArgs(mixtral.ModelArgs):
    """Mixtral's fields (its head_dim and GQA defaults included), MiniMax-M2's defaults, and its q/k norm."""

    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 196608
    use_qk_norm: bool = True

    @property
    def rotary_dim(self) -> int:
        """The released configs' `rotary_dim`, else transformers' `partial_rotary_factor` (default: all)."""
        raw = self.raw or {}
        if raw.get("rotary_dim"):
            return int(raw["rotary_dim"])
        factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        return int(self.head_dim * float(factor))


def check_config(cfg: dict) -> None:
    """Refuse MiniMax configs this file does not implement (MiniMax-Text-01's lightning attention, a
    shared expert, a softmax router)."""
    def refuse(field: str, value, want: str):
        _refuse("minimax_m2", field, value, want)

    check_act_and_rope("minimax_m2", cfg)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        refuse("scoring_func", cfg["scoring_func"], "only sigmoid")
    if cfg.get("qk_norm_type", "per_layer") != "per_layer":
        refuse("qk_norm_type", cfg["qk_norm_type"], "per_layer: one RMSNorm over the whole q / k projection")
    if cfg.get("use_routing_bias", True) is False:
        refuse("use_routing_bias", False, "the released models route with a correction bias")
    if cfg.get("shared_intermediate_size"):
        refuse("shared_intermediate_size", cfg["shared_intermediate_size"], "no shared expert")
    kinds = cfg.get("attn_type_list")
    if isinstance(kinds, list) and any(k != 1 for k in kinds):
        refuse("attn_type_list", kinds, "full attention in every layer (1); linear attention is MiniMax-Text-01's")
    a = ModelArgs.from_dict(cfg)
    if not 0 < a.rotary_dim <= a.head_dim or a.rotary_dim % 2:  # type: ignore[operator]
        refuse("rotary_dim", a.rotary_dim, f"an even number of channels in 2..head_dim={a.head_dim}")


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw, 5e6), rope_scaling(raw), a.max_position_embeddings,
                                       rotary_dim=a.rotary_dim), qk_norm=QKNorm.FULL if a.use_qk_norm else QKNorm.NONE,
                             norm_eps=a.rms_norm_eps)
        def moe(i: int) -> SparseMoE:  # (one group: the plain biased top-k, weights renormalised, unscaled)
            gate = GroupLimitedRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, 1, 1, True, 1.0)
            return SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_local_experts))

        blocks = [DecoderBlock(Attention(attn), moe(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the released checkpoints' `block_sparse_moe` is `mlp`, and the router's
    correction bias sits on the MoE block there (and in transformers), on the router here."""
    return mixtral.sanitize(name).replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")


FAMILY = Family("minimax_m2", ModelArgs, Model, check_config=check_config, sanitize=sanitize)
