"""Aria's text model (`aria_text`; the released multimodal `aria`, Rhymes AI's Aria, 25.3B-A3.9B, converts to it):
Llama's attention with an MoE in every layer:

- Mixtral's router in effect: the top k of the router logits, weighted by a softmax over those k, which is the
  softmax over all experts renormalised over the k.
- SiLU-GLU experts of width `intermediate_size`, stored x @ W as released and as transformers keeps them
  (`fc1` / `gate_up_proj` [E, hidden, 2I] with the gate columns first, `fc2` / `down_proj` [E, I, hidden]):
  `expert_record` turns each into the canonical [2I, hidden] and [hidden, I].
- Shared experts that every token runs: one SwiGLU MLP of `moe_num_shared_experts` x `intermediate_size`.
- The released checkpoint keeps the text model under `language_model.` (`language_model.model.`,
  `language_model.lm_head`), transformers' under `model.language_model.`; the vision tower and the projector are
  dropped, so images are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ColibriError
from ..layers.attention import Attention, AttentionArgs, Output, Positions
from ..layers.layers import MLP, DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU, TopKRouter
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family

NAME = "aria_text"
_RENAMES = ((".mlp.experts.fc1.weight", ".mlp.experts.gate_up_proj"),
            (".mlp.experts.fc2.weight", ".mlp.experts.down_proj"),
            (".mlp.router.weight", ".mlp.gate.weight"))
_DROPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    moe_num_experts: int = 8
    moe_topk: int = 2
    moe_num_shared_experts: int = 2
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(a.raw or {}, 10000.0), rope_scaling(a.raw or {}),
                                       a.max_position_embeddings), bias=a.attention_bias, norm_eps=a.rms_norm_eps,
                             output=Output(o_bias=a.attention_bias))

        def moe(i: int) -> SparseMoE:
            shared = MLP(a.hidden_size, a.intermediate_size * a.moe_num_shared_experts)
            return SparseMoE(TopKRouter(a.hidden_size, a.moe_num_experts, a.moe_topk, True),
                             SwitchGLU(i, a.hidden_size, a.intermediate_size, a.moe_num_experts), shared,
                             shared_name="shared_experts")

        blocks = [DecoderBlock(Attention(attn), moe(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict) -> None:
    check_act_and_rope(NAME, cfg)  # (the shared experts' activation; the routed ones are always SiLU)
    if cfg.get("mlp_bias"):
        refuse(NAME, "mlp_bias", cfg["mlp_bias"], "the released model has no MLP biases")
    if cfg.get("moe_num_shared_experts", 2) < 1:  # (transformers keeps a zero-width shared MLP then)
        refuse(NAME, "moe_num_shared_experts", cfg["moe_num_shared_experts"], ">= 1, as released (2)")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the text model moves up (`language_model.model.` / `model.language_model.`), the
    experts and the router take their canonical names, the vision tower and the projector go."""
    if name.startswith(_DROPPED):
        return None
    if name.startswith("language_model."):
        name = name.removeprefix("language_model.")
    elif name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    return rename_first(name, _RENAMES)


def expert_record(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's canonical record from its x @ W slices: gate_up [hidden, 2I] (gate columns first) and down
    [I, hidden] become gate_up [2I, hidden] (gate rows first) and down [hidden, I]."""
    if "gate_up" not in parts or "down" not in parts:
        raise ColibriError(f"{NAME} expert lacks gate_up/down (have {sorted(parts)})")
    gu, dn = parts["gate_up"], parts["down"]
    if gu.dim() != 2 or dn.dim() != 2 or gu.shape[1] != 2 * dn.shape[0] or gu.shape[0] != dn.shape[1]:
        raise ColibriError(f"{NAME} experts: gate_up {tuple(gu.shape)} and down {tuple(dn.shape)} are not "
                           "[hidden, 2I] and [I, hidden]")
    return {"gate_up.weight": gu.T.contiguous(), "down.weight": dn.T.contiguous()}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, expert_record=expert_record)
