"""Cohere's Command A MoE (`cohere2_moe`): Cohere 2's parallel blocks over Mixtral-style experts.

- Parallel block: h + attn(norm(h)) + mlp(norm(h)), one input norm per layer (a LayerNorm without bias, or an
  RMSNorm when `rms_norm_eps` is set), no norm between the two.
- Attention: RoPE on interleaved pairs (the converter moves q/k rows to rotate-half order, as for ERNIE) on the
  sliding layers and on the dense prefix layers when `prefix_dense_sliding_window_pattern` is 1; the other full
  layers use none. `layer_types` / `mlp_layer_types`, else transformers' patterns from `first_k_dense_replace`.
- MoE: the top k logits, weighted by their softmax (gpt-oss's rule: the kernels' top-k softmax with a zero bias)
  or by their sigmoid, renormalised (`expert_selection_fn`); experts of `intermediate_size`; `num_shared_experts`
  as one MLP, added or averaged with the routed output ("average": the router's weights and the shared expert's
  down projection halved).
- Head: tied to the embedding by default, times `logit_scale` (folded into the stored lm_head).

The kernels' attention block hands the MLP its input norm's output (coli_attn_output.parallel), so the blocks run
in the one-call step like the sequential ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import Attention, AttentionArgs, Output, Positions, Scores
from ..layers.layers import MLP, DecoderBlock, LayerNorm, RMSNorm, rope_scaling, rope_theta, rotate_half_rows
from ..layers.moe import BiasedLogitRouter, SoftmaxTopKRouter, SparseMoE, SwitchGLU
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family

NAME = "cohere2_moe"
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 128
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    rms_norm_eps: float | None = None
    attention_bias: bool = False
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 4
    prefix_dense_sliding_window_pattern: int = 1
    prefix_dense_intermediate_size: int | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 0
    shared_expert_combination_strategy: str = "average"
    expert_selection_fn: str = "softmax"
    norm_topk_prob: bool = True
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.layer_types, self.mlp_layer_types = patterns(self.raw or {}, self.num_hidden_layers)

    def averages(self) -> bool:
        """Whether a sparse layer's output is (routed + shared) / 2."""
        return bool(self.num_shared_experts) and self.shared_expert_combination_strategy == "average"

    def rotates(self, i: int) -> bool:
        """transformers' Cohere2MoeAttention: RoPE on sliding layers, and on dense layers while the dense prefix's
        pattern is 1."""
        return self.layer_types[i] == "sliding_attention" or (  # type: ignore[index]
            self.mlp_layer_types[i] == "dense" and self.prefix_dense_sliding_window_pattern == 1)  # type: ignore[index]


def patterns(cfg: dict, n: int) -> tuple[list[str], list[str]]:
    """(layer_types, mlp_layer_types) as transformers' Cohere2MoeConfig decides them."""
    k = int(cfg.get("first_k_dense_replace") or 0)
    kinds = cfg.get("layer_types")
    if kinds is None:
        every = int(cfg.get("sliding_window_pattern", 4))
        prefix = int(cfg.get("prefix_dense_sliding_window_pattern", 1))
        kinds = [KINDS[bool((i + 1) % prefix)] for i in range(min(k, n))] + \
                [KINDS[bool((i + 1) % every)] for i in range(n - min(k, n))]
    mlps = cfg.get("mlp_layer_types")
    if mlps is None:
        mlps = ["dense" if i < k else "sparse" for i in range(n)]
    return list(kinds), list(mlps)


def router(hidden: int, num_experts: int, top_k: int, fn: str, norm: bool, scale: float) -> nn.Module:
    """The top k logits weighted by their softmax (gpt-oss's / Granite's router) or by their sigmoids, renormalised
    when `norm` (Kolibri-1's with no bias); neither has a tensor to load."""
    if fn == "softmax":
        return SoftmaxTopKRouter(hidden, num_experts, top_k, bias=False, scale=scale)
    return BiasedLogitRouter(hidden, num_experts, top_k, norm, bias=False, scale=scale)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}

        def norm() -> nn.Module:
            if a.rms_norm_eps is not None:
                return RMSNorm(a.hidden_size, a.rms_norm_eps)
            return LayerNorm(a.hidden_size, a.layer_norm_eps, bias=False)

        def block(i: int) -> DecoderBlock:
            sliding = a.layer_types[i] == "sliding_attention"  # type: ignore[index]
            attn = Attention(AttentionArgs(
                a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,  # type: ignore[arg-type]
                Positions(rope_theta(raw), rope_scaling(raw), a.max_position_embeddings, use_rope=a.rotates(i)),
                bias=a.attention_bias, scores=Scores(sliding_window=a.sliding_window if sliding else None),
                output=Output(parallel=True)))
            if a.mlp_layer_types[i] == "dense":  # type: ignore[index]
                mlp: nn.Module = MLP(a.hidden_size, a.prefix_dense_intermediate_size or a.intermediate_size)
            else:
                gate = router(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.expert_selection_fn,
                              a.norm_topk_prob, 0.5 if a.averages() else 1.0)
                shared = MLP(a.hidden_size, a.intermediate_size * a.num_shared_experts) if a.num_shared_experts \
                    else None
                mlp = SparseMoE(gate, SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_experts), shared,
                                shared_name="shared_experts")
            return DecoderBlock(attn, mlp, a.hidden_size, 0.0, norm=norm())

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps or a.layer_norm_eps,
                         [block(i) for i in range(a.num_hidden_layers)])
        self.model.norm = norm()
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Cohere 2 MoE configs this file does not implement."""
    check_act_and_rope(NAME, cfg)
    n = int(cfg.get("num_hidden_layers") or 0)
    kinds, mlps = patterns(cfg, n)
    if len(kinds) != n or any(k not in KINDS for k in kinds):
        refuse(NAME, "layer_types", cfg.get("layer_types"), f"{n} entries of {' / '.join(KINDS)}")
    if len(mlps) != n or any(k not in ("dense", "sparse") for k in mlps):
        refuse(NAME, "mlp_layer_types", cfg.get("mlp_layer_types"), f'{n} entries of "dense" / "sparse"')
    if "sliding_attention" in kinds and not cfg.get("sliding_window", 4096):
        refuse(NAME, "sliding_window", cfg.get("sliding_window"), "a window of at least 1 for the sliding layers")
    if cfg.get("expert_selection_fn", "softmax") not in ("softmax", "sigmoid"):
        refuse(NAME, "expert_selection_fn", cfg["expert_selection_fn"], "softmax or sigmoid")
    if cfg.get("shared_expert_combination_strategy", "average") not in ("average", "sum"):
        refuse(NAME, "shared_expert_combination_strategy", cfg["shared_expert_combination_strategy"],
               "average or sum")
    if int(cfg.get("head_dim", 128)) % 2:
        refuse(NAME, "head_dim", cfg["head_dim"], "an even number (RoPE pairs)")


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Stored tensors as the engine's layers want them: q/k rows in rotate-half order (Cohere rotates interleaved
    pairs), the head times `logit_scale`, and "average" folded into the shared expert's down projection."""
    D = int(cfg.get("head_dim", 128))
    if name.endswith((".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.q_proj.bias",
                      ".self_attn.k_proj.bias")):
        return rotate_half_rows(t, D)
    factor = 1.0
    if name == "lm_head.weight":
        factor = float(cfg.get("logit_scale", 0.0625))
    elif ".mlp.shared_experts.down_proj." in name and ModelArgs.from_dict(cfg).averages():
        factor = 0.5  # (the routed half: the router's scale)
    return t if factor == 1.0 else (t.float() * factor).to(t.dtype)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, prepare=prepare)
