"""DeepSeek-V2 (and V2-Lite, V2.5, Coder-V2): Multi-head Latent Attention with a latent KV
cache, dense first layers, shared experts, softmax router with greedy or group-limited top-k.

- Layer i is MoE when `i >= first_k_dense_replace` and `i % moe_layer_freq == 0`, else a
  dense SwiGLU MLP of `intermediate_size`.
- Router (`topk_method`): softmax over all experts; "greedy" keeps the top k,
  "group_limited_greedy" first keeps the `topk_group` best of `n_group` expert groups
  (a group scores its best expert) and picks the top k inside them. The k weights are
  multiplied by `routed_scaling_factor`, or renormalised to sum 1 instead when
  `norm_topk_prob` (DeepSeek's reference code; transformers ignores the flag, and every
  released V2 config has it false). `moe_layer_freq` likewise follows DeepSeek's code.
- RoPE pairs are interleaved (DeepSeek's complex-number layout); YaRN scaling also
  multiplies the softmax scale by mscale(factor, mscale_all_dim)^2.
- Checkpoint names are already canonical (no `sanitize`). Pre-quantized checkpoints (FP8
  blocks, compressed-tensors) are dequantized by the converter (colibri/convert/source_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ColibriError
from ..kernels import native
from ..layers.layers import MLP, DecoderBlock, rope_inv_freq, rope_scaling, rope_theta
from ..layers.mla import MLAArgs, MLAttention
from ..layers.moe import RouteRule, SparseMoE, SwitchGLU, native_route
from .base import BaseArgs, CausalLM
from .family import Family

TOPK_METHODS = ("greedy", "group_limited_greedy")
SCORING = "softmax"


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    topk_method: str = "greedy"
    scoring_func: str = SCORING
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    raw: dict | None = None

    def is_moe(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def rope_interleaved(self) -> bool:
        return True  # V2 rotates (x0, x1), (x2, x3)... as complex numbers, whatever the config says

    def mla(self) -> MLAArgs:
        raw = self.raw or {}
        return MLAArgs(self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank,
                       self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, rope_theta(raw),
                       rope_scaling(raw), self.max_position_embeddings, self.rope_interleaved(),
                       self.attention_bias)


class Router(nn.Module):
    """Softmax scores, (group-limited) greedy top-k: `x [T, H] -> (idx [T, k], weights [T, k])`."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        E = a.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, a.hidden_size), requires_grad=False)  # [E, H], f32
        self.top_k, self.method = a.num_experts_per_tok, a.topk_method
        self.n_group, self.topk_group = a.n_group, a.topk_group
        self.scaling, self.norm_topk_prob = a.routed_scaling_factor, a.norm_topk_prob

    def native_routing(self) -> RouteRule:
        """The native router's softmax rule (kernels/route.c coli_route): renormalised when norm_topk_prob and
        k > 1, else times routed_scaling_factor (forward's rule); group_limited_greedy's groups by their best
        probability (keep_groups)."""
        groups = (self.n_group, self.topk_group) if self.method == "group_limited_greedy" else (1, 1)
        return RouteRule(native.ROUTE_SOFTMAX, self.norm_topk_prob and self.top_k > 1, None, float(self.scaling),
                         groups)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        scores = torch.softmax(x.float() @ self.weight.T, dim=-1)  # [T, E]
        if self.method == "group_limited_greedy":
            T, E = scores.shape
            best = scores.view(T, self.n_group, E // self.n_group).amax(-1)  # [T, G]: a group's best expert
            keep = torch.zeros_like(best, dtype=torch.bool)
            keep.scatter_(1, best.topk(self.topk_group, -1).indices, True)  # [T, G]
            scores = scores.masked_fill(~keep.repeat_interleave(E // self.n_group, 1), 0.0)  # [T, E]
        weights, idx = torch.topk(scores, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob and self.top_k > 1:
            return idx, weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling


def moe_block(a: ModelArgs, i: int, router: nn.Module) -> nn.Module:
    """Routed experts + `n_shared_experts` always-on experts fused into one MLP."""
    shared = MLP(a.hidden_size, a.moe_intermediate_size * a.n_shared_experts) if a.n_shared_experts else None
    return SparseMoE(router, SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.n_routed_experts),
                     shared, shared_name="shared_experts")


class Model(CausalLM):
    router_cls: type[nn.Module] = Router

    def __init__(self, a: ModelArgs):
        mla = a.mla()

        def mlp(i: int) -> nn.Module:
            if not a.is_moe(i):
                return MLP(a.hidden_size, a.intermediate_size)
            return moe_block(a, i, type(self).router_cls(a))

        blocks = [DecoderBlock(MLAttention(mla), mlp(i), a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


# ----------------------------------------------------------------------------- conversion


def check_common(cfg: dict) -> None:
    """Refuses what an MLA family cannot honour, naming the config field."""
    scaling = rope_scaling(cfg)
    if scaling is not None:
        try:
            rope_inv_freq(int(cfg.get("qk_rope_head_dim", 64)), rope_theta(cfg), scaling,
                          int(cfg.get("max_position_embeddings", 4096)))
        except (ValueError, KeyError, TypeError) as e:
            raise ColibriError(f"config rope_scaling/rope_parameters: {e}") from None
    if cfg.get("hidden_act", "silu") != "silu":
        raise ColibriError(f"config hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    n_exp, n_group = int(cfg.get("n_routed_experts") or 0), cfg.get("n_group") or 1
    if n_exp and n_exp % n_group:
        raise ColibriError(f"config n_group {n_group} does not divide n_routed_experts {n_exp}")
    topk_group = cfg.get("topk_group") or 1
    if n_exp and not 1 <= topk_group <= n_group:
        raise ColibriError(f"config topk_group {topk_group} must be between 1 and n_group {n_group}")


def check_config(cfg: dict) -> None:
    check_common(cfg)
    if cfg.get("topk_method", "greedy") not in TOPK_METHODS:
        raise ColibriError(f"config topk_method '{cfg['topk_method']}' is not supported by deepseek_v2 "
                           f"(supported: {', '.join(TOPK_METHODS)})")
    if cfg.get("scoring_func", SCORING) != SCORING:
        raise ColibriError(f"config scoring_func '{cfg['scoring_func']}' is not supported by deepseek_v2 "
                           f"(supported: {SCORING})")


FAMILY = Family("deepseek_v2", ModelArgs, Model, check_config=check_config)
