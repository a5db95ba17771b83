"""Hunyuan-A13B (`hunyuan_v1_moe`): GQA attention whose per-head q/k RMSNorm comes after the rotary, RoPE
with Hunyuan's NTK alpha (the base stretched by alpha^(d / (d - 2))), every layer a softmax top-k router
(renormalised) over the routed experts plus one shared MLP of the same width -- transformers'
HunYuanMoEV1 model, which the oracle tests compare against. The hub checkpoints' names (`mlp.gate.wg`,
`self_attn.query_layernorm`) map to the canonical ones here; what transformers' port does not implement
(cross-layer attention, per-layer expert counts or widths) is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import Attention, AttentionArgs, Positions, QKNorm
from ..layers.layers import MLP, DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"attention_head_dim": "head_dim"}

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    vocab_size: int
    moe_topk: int | list[int] = 1
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    use_qk_norm: bool = True
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if isinstance(self.moe_topk, list):  # (one value per layer, all equal: check_config)
            self.moe_topk = self.moe_topk[0]


def _same(v) -> bool:
    return not isinstance(v, list) or len(set(v)) <= 1


def check_config(cfg: dict) -> None:
    check_act_and_rope("hunyuan_v1_moe", cfg)
    for key in ("moe_topk", "num_experts", "num_shared_expert"):
        if not _same(cfg.get(key)):
            refuse("hunyuan_v1_moe", key, cfg[key], "one value for every layer")
    shared = cfg.get("num_shared_expert")
    if shared is not None and (shared[0] if isinstance(shared, list) and shared else shared) != 1:
        refuse("hunyuan_v1_moe", "num_shared_expert", shared, "1, a shared MLP as wide as an expert")
    width = cfg.get("moe_intermediate_size")
    if width is not None and any(w != cfg.get("intermediate_size") for w in (width if isinstance(width, list)
                                                                              else [width])):
        refuse("hunyuan_v1_moe", "moe_intermediate_size", width, "the experts as wide as intermediate_size")
    if cfg.get("use_cla"):
        refuse("hunyuan_v1_moe", "use_cla", cfg["use_cla"], "false: cross-layer attention is not implemented")
    if cfg.get("use_mixed_mlp_moe") is False:
        refuse("hunyuan_v1_moe", "use_mixed_mlp_moe", False, "true: the shared MLP beside the experts")


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw), rope_scaling(raw), a.max_position_embeddings),
                             bias=a.attention_bias, qk_norm=QKNorm.HEAD_POST_ROPE if a.use_qk_norm else QKNorm.NONE,
                             norm_eps=a.rms_norm_eps)

        def moe(i: int) -> SparseMoE:
            return SparseMoE(TopKRouter(a.hidden_size, a.num_experts, a.moe_topk, True),
                             SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_experts),
                             MLP(a.hidden_size, a.intermediate_size), shared_name="shared_mlp")

        blocks = [DecoderBlock(Attention(attn), moe(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def sanitize(name: str) -> str:
    """HF name -> canonical name: the router's `wg`, the q/k norms' names."""
    return (name.replace(".mlp.gate.wg.", ".mlp.gate.").replace(".self_attn.query_layernorm.", ".self_attn.q_norm.")
            .replace(".self_attn.key_layernorm.", ".self_attn.k_norm."))


FAMILY = Family("hunyuan_v1_moe", ModelArgs, Model, check_config=check_config, sanitize=sanitize)
