"""DeepSeek-V3 / R1 (and its layout under other names: Kimi-K2's `kimi_k2`, Moonlight's `deepseek_v3`): DeepSeek-V2's
MLA + shared-expert layout with the auxiliary-loss-free sigmoid router.

- Router (`topk_method` "noaux_tc", `scoring_func` "sigmoid"): s = sigmoid(x W^T). Selection
  uses s + e_score_correction_bias: the `topk_group` best of `n_group` groups (a group scores
  the sum of its two best experts), then the top k inside them. The weights come from the
  *unbiased* s of the chosen experts, renormalised when `norm_topk_prob`, then multiplied by
  `routed_scaling_factor`.
- RoPE: `rope_interleave` (default true) rotates interleaved pairs, as DeepSeek's weights
  expect; false rotates halves. YaRN multiplies the softmax scale by mscale(factor, mscale_all_dim)^2.
- Converter: the multi-token-prediction module that V3 checkpoints append as layer
  `num_hidden_layers` (embed/enorm/hnorm/eh_proj/shared_head + one decoder layer, counted by
  `num_nextn_predict_layers`) is kept (layers/mtp.py; `--spec mtp` drafts with it), an MoE layer
  (`mtp_config`). FP8 weights (F8_E4M3 with
  per-128x128-block `weight_scale_inv`, quantization_config.quant_method "fp8") are
  dequantized by the converter before re-quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ColibriError
from ..kernels import native
from ..layers.moe import RouteRule, native_route
from . import deepseek_v2 as v2
from .deepseek_v2 import check_common
from .family import Family

TOPK_METHODS = ("noaux_tc",)
SCORING = "sigmoid"


@dataclass
class ModelArgs(v2.ModelArgs):
    topk_method: str = "noaux_tc"
    scoring_func: str = SCORING
    norm_topk_prob: bool = True
    rope_interleave: bool = True

    def rope_interleaved(self) -> bool:
        return self.rope_interleave


class Router(nn.Module):
    """Sigmoid scores, bias-corrected group-limited selection: `x [T, H] -> (idx [T, k], weights [T, k])`."""

    MASKED = float("-inf")  # what an expert outside the kept groups scores for the choice (A.X K2's: 0.0)

    def __init__(self, a: ModelArgs):
        super().__init__()
        E = a.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, a.hidden_size), requires_grad=False)  # [E, H]
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)  # [E]
        self.top_k, self.n_group, self.topk_group = a.num_experts_per_tok, a.n_group, a.topk_group
        self.scaling, self.norm_topk_prob = a.routed_scaling_factor, a.norm_topk_prob

    def native_routing(self) -> RouteRule | None:
        """The native router's sigmoid rule (kernels/route.c route_select_sigmoid, GLM-4.5's), as (selection
        bias, weight scale), limited to the best topk_group of n_group groups (keep_groups: a group's two best,
        or its one where a group has one expert, as min(2, per_group) below); else torch's."""
        b = self.e_score_correction_bias
        if b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous() \
                or (self.n_group > 1 and self.MASKED != float("-inf")):  # (the kernel drops the other groups)
            return None
        return RouteRule(native.ROUTE_SIGMOID, self.norm_topk_prob, b, self.scaling, (self.n_group, self.topk_group))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        scores = torch.sigmoid(x.float() @ self.weight.T)  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]: only for choosing, never as a weight
        T, E = choice.shape
        per_group = E // self.n_group
        grouped = choice.view(T, self.n_group, per_group)
        group_score = grouped.topk(min(2, per_group), -1).values.sum(-1)  # [T, G]: sum of the two best
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_group, -1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, 1), self.MASKED)
        idx = choice.topk(self.top_k, -1).indices  # [T, k]
        weights = scores.gather(1, idx)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling


class Model(v2.Model):
    router_cls = Router


def sanitize(name: str) -> str | None:
    """Kimi-K2.5's multimodal checkpoint (`kimi_k25`): the text model's names under `language_model.` (its
    `model.*` and `lm_head`) lose that prefix; its vision tower and projector go. (Plain DeepSeek-V3 / Kimi-K2
    checkpoints have none of these.)"""
    if name.startswith(("vision_tower.", "mm_projector.")):
        return None
    return name.removeprefix("language_model.")


def check_config(cfg: dict) -> None:
    check_common(cfg)
    if cfg.get("topk_method", "noaux_tc") not in TOPK_METHODS:
        raise ColibriError(f"config topk_method '{cfg['topk_method']}' is not supported by deepseek_v3 "
                           f"(supported: {', '.join(TOPK_METHODS)})")
    if cfg.get("scoring_func", SCORING) != SCORING:
        raise ColibriError(f"config scoring_func '{cfg['scoring_func']}' is not supported by deepseek_v3 "
                           f"(supported: {SCORING})")


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (past the first_k_dense_replace dense layers: routed) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1}


FAMILY = Family("deepseek_v3", ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_config=mtp_config)
