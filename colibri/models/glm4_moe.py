"""GLM-4.5 / 4.6 MoE: partial RoPE, q/k/v bias, optional per-head q/k norm, dense first layers,
shared experts, and a sigmoid router with a selection-only correction bias and group-limited top-k. The
multi-token-prediction layer (`num_nextn_predict_layers`, appended as layer `num_hidden_layers`, DeepSeek-V3's
layout) is kept: layers/mtp.py, `mtp_config`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native
from ..layers.attention import Attention, AttentionArgs, Positions, QKNorm, Scores
from ..layers.layers import MLP, DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import RouteRule, SparseMoE, SwitchGLU, native_route
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"num_local_experts": "n_routed_experts"}
    default_theta = 10000.0  # (RoPE's base when the config gives none; Hy3's differs)

    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    use_qk_norm: bool = False
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * partial_rotary_factor(self.raw or {}))

    # The layer pattern, for the families built on this one (dots1's windows, EXAONE's NoPE and dense layers).
    def window(self, i: int) -> int | None:
        """Layer i's sliding window; None: full attention."""
        return None

    def rope_on(self, i: int) -> bool:
        return True

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


def partial_rotary_factor(cfg: dict) -> float:
    """v5 keeps it in `rope_parameters`, v4 at the top level; GLM's default is half the head."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))


def check_config(cfg: dict, family: str = "glm4_moe") -> None:
    """Refuse GLM configs whose routing, activation, rope or weight format this file does not implement
    (`family`: the name the errors give, for the families built on this one)."""
    check_act_and_rope(family, cfg)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(family, "scoring_func", cfg["scoring_func"], "only sigmoid")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(family, "topk_method", cfg["topk_method"], "only noaux_tc")
    experts, groups = int(cfg.get("n_routed_experts", 128)), int(cfg.get("n_group") or 1)
    if experts % groups or experts // groups < 2:
        refuse(family, "n_group", groups, f"must split n_routed_experts={experts} into groups of >= 2")
    if not 1 <= int(cfg.get("topk_group") or 1) <= groups:
        refuse(family, "topk_group", cfg.get("topk_group"), f"must be in 1..n_group={groups}")


class GroupLimitedRouter(nn.Module):
    """Sigmoid scores per expert. `e_score_correction_bias` (a load-balancing offset) only decides
    *which* experts win, inside the `topk_group` best groups; the mixing weights are the unbiased
    sigmoid scores, optionally renormalised over the chosen k, then times `routed_scaling_factor`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, bias: bool = True, renorm_eps: float = 1e-20):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H]
        if bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)  # [E]
        else:  # (no bias to load, Flint's: zeros, so the kernels' sigmoid rule runs it)
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts), persistent=False)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scale = norm_topk_prob, routed_scaling_factor
        self.renorm_eps = renorm_eps  # (the renormalisation's denominator guard: LFM2's transformers code adds 1e-6)

    def native_routing(self) -> RouteRule | None:
        """The native router's sigmoid rule (kernels/route.c route_select_sigmoid), as (selection bias, weight
        scale), in groups where there are several (keep_groups: the sum of a group's two best)."""
        b = self.e_score_correction_bias
        if b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous() \
                or self.weight.shape[0] // self.n_group < 2:  # (torch's topk(2) per group needs two)
            return None
        return RouteRule(native.ROUTE_SIGMOID, self.norm_topk_prob, b, self.scale, (self.n_group, self.topk_group))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        T, E = x.shape[0], self.weight.shape[0]
        scores = torch.sigmoid(x.float() @ self.weight.float().T)  # [T, E]
        choice = scores + self.e_score_correction_bias.float()  # [T, E], selection only
        # A group's strength is the sum of its two best (biased) scores; keep the topk_group best groups.
        groups = choice.view(T, self.n_group, E // self.n_group)  # [T, G, E/G]
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [T, G]
        best = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, idx)  # [T, k], unbiased
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + self.renorm_eps)
        return idx, weights * self.scale


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}

        def attn(i: int) -> AttentionArgs:
            return AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                 Positions(rope_theta(raw, a.default_theta), rope_scaling(raw),
                                           a.max_position_embeddings, rotary_dim=a.rotary_dim, use_rope=a.rope_on(i)),
                                 bias=a.attention_bias, qk_norm=QKNorm.HEAD if a.use_qk_norm else QKNorm.NONE,
                                 norm_eps=a.rms_norm_eps, scores=Scores(sliding_window=a.window(i)))

        def mlp(i: int) -> nn.Module:
            if not a.is_moe(i):
                return MLP(a.hidden_size, a.intermediate_size)
            gate = GroupLimitedRouter(a.hidden_size, a.n_routed_experts, a.num_experts_per_tok, a.n_group,
                                      a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
            shared = MLP(a.hidden_size, a.moe_intermediate_size * a.n_shared_experts)
            return SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.n_routed_experts),
                             shared, shared_name="shared_experts")

        blocks = [DecoderBlock(Attention(attn(i)), mlp(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (past the dense first layers: routed) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0}


FAMILY = Family("glm4_moe", ModelArgs, Model, check_config=check_config, mtp_config=mtp_config)
