"""ERNIE-4.5 MoE (Baidu; 21B-A3B, 300B-A47B): Llama attention with RoPE on interleaved channel pairs, dense
layers outside [moe_layer_start_index, moe_layer_end_index] (and off the moe_layer_interval), shared experts,
and a softmax router whose `moe_statics.e_score_correction_bias` only picks the experts; the mixing weights
are the unbiased probabilities, renormalised (the sum clamped at moe_norm_min).

The interleaved RoPE is turned into the rotate-half RoPE every other family uses at conversion (`prepare`):
within each head, q_proj's and k_proj's output rows are reordered so that channel pair (2i, 2i+1) becomes
(i, i + head_dim/2). q and k move alike, so every attention score -- and the output -- is unchanged, and the
native attention kernels run the layer as they are.

The multi-token-prediction layer (`model.mtp_emb_norm.0`, `mtp_hidden_norm.0`, `mtp_linear_proj.0`, `mtp_block.0`)
is kept (layers/mtp.py): Baidu's FastDeploy runs it on the model's normed output, as layer 0 of the model, and
ends it with the model's own final norm (`mtp_model_norm`), as here."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native
from ..layers.attention import Attention, AttentionArgs, Positions
from ..layers.layers import MLP, DecoderBlock, rope_scaling, rope_theta, rotate_half_rows
from ..layers.moe import RouteRule, SparseMoE, SwitchGLU, native_route
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"moe_num_experts": "num_experts", "moe_k": "num_experts_per_tok"}

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_experts: int = 64
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1536
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    moe_num_shared_experts: int = 2
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def is_sparse(self, i: int) -> bool:
        end = self.num_hidden_layers - 1 if self.moe_layer_end_index == -1 else self.moe_layer_end_index
        return (i + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= i <= end


def check_config(cfg: dict) -> None:
    check_act_and_rope("ernie4_5_moe", cfg)
    if cfg.get("use_bias"):
        refuse("ernie4_5_moe", "use_bias", cfg["use_bias"], "the released models have no linear biases")
    if int(cfg.get("moe_layer_interval") or 1) < 1:
        refuse("ernie4_5_moe", "moe_layer_interval", cfg.get("moe_layer_interval"), ">= 1")


class Router(nn.Module):
    """Softmax over all experts in f32; the top k of (probabilities + correction bias) are chosen, weighted by
    their unbiased probabilities over max(their sum, norm_min)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_min: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H], f32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, num_experts), requires_grad=False)  # [1, E]
        self.top_k, self.norm_min = top_k, norm_min

    def native_routing(self) -> RouteRule | None:
        """The native router's softmax-with-bias rule (kernels/route.c route_select_softmax_bias), always
        renormalised, over max(sum, norm_min); None where the bias is not an f32 CPU tensor."""
        b = self.e_score_correction_bias
        if b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous():
            return None
        return RouteRule(native.ROUTE_SOFTMAX_BIAS, True, b.view(-1), float(self.norm_min))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        probs = torch.softmax(x.float() @ self.weight.float().T, dim=-1)  # [T, E]
        idx = torch.topk(probs + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices  # [T, k]
        weights = probs.gather(1, idx)  # [T, k]
        return idx, weights / weights.sum(-1, keepdim=True).clamp(min=self.norm_min)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        attn = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw, 500000.0), rope_scaling(raw), a.max_position_embeddings),
                             norm_eps=a.rms_norm_eps)

        def mlp(i: int) -> nn.Module:
            if not a.is_sparse(i):
                return MLP(a.hidden_size, a.intermediate_size)
            gate = Router(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.moe_norm_min)
            shared = MLP(a.hidden_size, a.moe_intermediate_size * a.moe_num_shared_experts) \
                if a.moe_num_shared_experts > 0 else None
            return SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts), shared,
                             shared_name="shared_experts")

        blocks = [DecoderBlock(Attention(attn), mlp(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


# the release's multi-token-prediction names -> layers/mtp.py's (its layer's own norm is the model's: `Family`)
MTP = re.compile(r"model\.mtp_(emb_norm|hidden_norm|linear_proj|block)\.(\d+)\.(.+)")
MTP_ROLES = {"emb_norm": "enorm", "hidden_norm": "hnorm", "linear_proj": "eh_proj", "block": "block"}


def sanitize(name: str) -> str | None:
    """The router's correction bias sits in `mlp.moe_statics` in the released checkpoints (`mlp.gate.moe_statics`
    in transformers' own layout), on the router here; the multi-token-prediction layer's names become
    `mtp.{j}.*`."""
    if m := MTP.fullmatch(name):
        name = f"mtp.{m[2]}.{MTP_ROLES[m[1]]}.{m[3]}"
    elif name.startswith(("mtp", "model.mtp")):
        return None
    return name.replace(".mlp.gate.moe_statics.", ".mlp.gate.").replace(".mlp.moe_statics.", ".mlp.gate.")


def mtp_config(cfg: dict) -> dict:
    """The MTP layer as layer 0 of a one-layer model: dense or routed by the model's own rule for index 0 (Baidu's
    FastDeploy builds it as layer 0), so dense in the releases, whose routed layers start past it."""
    return {**cfg, "num_hidden_layers": 1}


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """A tensor as read, made into what this family's layers compute with: q_proj / k_proj rows reordered
    per head from interleaved RoPE pairs to rotate-half ones (module docstring)."""
    if not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        return t
    return rotate_half_rows(t, ModelArgs.from_dict(cfg).head_dim)


FAMILY = Family("ernie4_5_moe", ModelArgs, Model, check_config=check_config, sanitize=sanitize, prepare=prepare,
                mtp_config=mtp_config, mtp_model_norm=True)
