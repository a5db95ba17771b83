"""inclusionAI's Ling 3.0 hybrid (`bailing_hybrid`, transformers' port): groups of `layer_group_size` layers, Kimi
Delta Attention in all but the last of each group (kda.py, with full-rank gates: f_proj and g_proj, and by default
the bounded decay g = kda_lower_bound sigmoid(exp(A_log) (f + dt_bias))), MLA in the last (no q LoRA, DeepSeek's
interleaved RoPE, and a sigmoid gate per head on the heads' output: `GatedMLAttention`), over DeepSeek-V3's MoE
(sigmoid router with a selection bias in groups, renormalised, scaled; a shared expert) after `first_k_dense_replace`
dense layers.

- Layer kinds: `layer_types`, else full attention where (i + 1) % layer_group_size == 0; dense or MoE:
  `mlp_layer_types`, else the first `first_k_dense_replace` (default 2) dense.
- Widths: the KDA heads are `linear_num_heads` x `linear_head_dim` (transformers' saved names), else
  `num_attention_heads` x `head_dim` (its config's own: in a saved config `head_dim` is the rope width, so the linear
  names come first); the convolution `linear_conv_kernel_dim`, else `short_conv_kernel_size`.
- Names: the release's (`model.word_embeddings`, `attention.*` with `attention.dense` as o_proj, `q/k/v_conv1d`,
  `mlp.gate.expert_bias`, per-expert weights) and transformers' in-memory ones (`self_attn.forget_gate.*`, the
  concatenated `self_attn.conv1d`, read as three by kimi_linear's `source_view`).
- The multi-token-prediction layer past the last (`num_nextn_predict_layers`, the port's `num_mtp_layers`;
  DeepSeek-V3's layout with its norm named `final_layernorm`: vLLM's reading) is a gated-MLA MoE layer, kept
  (layers/mtp.py, `mtp_config`).

The KDA states keep prompt caching off. KDA rows take kernels/kda.c (rows and the whole decode block, full-rank
gates), the gated MLA layers kernels/mla.c's block (with the head gate), the MoE layers kernels/moe.c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import native
from ..layers.kda import KDAArgs, KimiDeltaAttention
from ..layers.layers import MLP, DecoderBlock, Linear
from ..layers.mla import MLAArgs, MLAttention
from . import deepseek_v3 as v3
from . import kimi_linear
from .base import CausalLM, refuse, rename_first
from .deepseek_v2 import moe_block
from .family import Family

NAME = "bailing_hybrid"


@dataclass
class ModelArgs(kimi_linear.ModelArgs):
    aliases = {**kimi_linear.ModelArgs.aliases, "num_mtp_layers": "num_nextn_predict_layers"}

    first_k_dense_replace: int = 2
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    layer_group_size: int = 6
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0

    def __post_init__(self):
        raw = self.raw or {}
        self.linear_head_dim = raw.get("linear_head_dim", raw.get("head_dim", self.linear_head_dim))
        self.linear_num_heads = raw.get("linear_num_heads", self.num_attention_heads)
        self.linear_conv_kernel_dim = raw.get("linear_conv_kernel_dim", raw.get("short_conv_kernel_size", 4))

    def kind(self, i: int) -> str:
        return layer_kinds(self.raw or {}, self.num_hidden_layers)[i]

    def rope_interleaved(self) -> bool:
        return True  # (transformers' port rotates interleaved pairs whatever the config says)

    def mla(self) -> MLAArgs:
        return v3.ModelArgs.mla(self)  # (with RoPE, unlike Kimi-Linear's)

    def kda(self) -> KDAArgs:
        return KDAArgs(self.hidden_size, self.linear_num_heads, self.linear_head_dim, self.linear_conv_kernel_dim,
                       self.rms_norm_eps, low_rank=False,
                       lower_bound=float(self.kda_lower_bound) if self.kda_safe_gate else 0.0,
                       a_log_shape=(self.linear_num_heads,))


def layer_kinds(cfg: dict, n_layers: int) -> list:
    """Per layer "linear_attention" or "full_attention", with transformers' precedence (module docstring)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    group = cfg.get("layer_group_size", 6)
    return ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n_layers)]


class GatedMLAttention(MLAttention):
    """MLA with Ling's head-wise output gate: each head's output times sigmoid(g_proj x) [T, H] before o_proj (in
    kernels/mla.c's block too, g_proj read with the other projections of x)."""

    fused = MLAttention.fused  # (DecoderBlock takes a class's own `fused` only)

    def __init__(self, a: MLAArgs):
        super().__init__(a)
        self.g_proj = Linear(a.hidden, a.heads)

    def _build_native_layer(self, in_norm, post_norm):
        layer = super()._build_native_layer(in_norm, post_norm)
        g, o = self.g_proj, self.o_proj
        if layer is None or getattr(g, "path", None) != "native" or g.bias is not None \
                or (g.scheme, g.group_size, g.compute_dtype) != (o.scheme, o.group_size, o.compute_dtype):
            return None
        layer.gated, layer.wg = 1, native.QW(*native.qw(g))
        return layer

    def out_gate(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)  # [T, H] (f32 sigmoid, as transformers)
        return (o.view(x.shape[0], self.a.heads, -1) * gate[..., None]).view(x.shape[0], -1)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        blocks = []
        for i in range(a.num_hidden_layers):
            attn = KimiDeltaAttention(a.kda()) if a.kind(i) == "linear_attention" else GatedMLAttention(a.mla())
            mlp = moe_block(a, i, v3.Router(a)) if a.is_moe(i) else MLP(a.hidden_size, a.intermediate_size)
            blocks.append(DecoderBlock(attn, mlp, a.hidden_size, a.rms_norm_eps))
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Ling hybrid configs this file does not implement (transformers' port is the reference)."""
    if not isinstance(cfg.get("layer_group_size", 6), int) or cfg.get("layer_group_size", 6) < 1:
        refuse(NAME, "layer_group_size", cfg.get("layer_group_size"), "a whole number of layers >= 1")
    kimi_linear.check_layers(NAME, cfg, layer_kinds)
    if cfg.get("kda_safe_gate", True) and cfg.get("kda_lower_bound", -5.0) >= 0:
        refuse(NAME, "kda_lower_bound", cfg["kda_lower_bound"], "a negative bound (the bounded decay's)")
    if cfg.get("linear_conv_kernel_dim", cfg.get("short_conv_kernel_size", 4)) < 2:
        refuse(NAME, "short_conv_kernel_size", cfg.get("short_conv_kernel_size"), "a kernel of at least 2 taps")
    if cfg.get("q_lora_rank") is not None:
        refuse(NAME, "q_lora_rank", cfg["q_lora_rank"], "none (the port's MLA has no q LoRA)")
    # fields of the original release (llama.cpp's BailingMoeV3 converter reads them) that transformers' port ignores:
    # a model that sets them otherwise would run as another model
    if cfg.get("no_kda_lora", True) is not True:
        refuse(NAME, "no_kda_lora", cfg["no_kda_lora"], "true (full-rank KDA gates, the port's)")
    if cfg.get("gated_attention_proj_granularity_type", "head_wise") != "head_wise":
        refuse(NAME, "gated_attention_proj_granularity_type", cfg["gated_attention_proj_granularity_type"],
               "head_wise")
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if any(v is not None for v in cfg.get(key) or []):
            refuse(NAME, key, cfg[key], "no SwiGLU clamps (the port has none)")
    shared = cfg.get("moe_shared_expert_intermediate_size")
    per = cfg.get("moe_intermediate_size", 768) * next((cfg[k] for k in ("num_shared_experts", "n_shared_experts")
                                                         if k in cfg), 1)
    if shared is not None and shared != per:
        refuse(NAME, "moe_shared_expert_intermediate_size", shared, f"moe_intermediate_size x shared experts ({per})")


_RENAMES = (("model.word_embeddings.", "model.embed_tokens."), (".attention.dense.", ".self_attn.o_proj."),
            (".attention.", ".self_attn."), (".self_attn.forget_gate.", ".self_attn."),
            (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))


def sanitize(name: str) -> str | None:
    """HF name (after `source_view`) -> canonical name (the MTP layer's own names: layers/mtp.py `canonical`)."""
    return rename_first(name, _RENAMES)


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (gated MLA, routed) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "layer_types": ["full_attention"], "mlp_layer_types": ["sparse"],
            "first_k_dense_replace": 0}


def source_view(st, cfg: dict):
    """The concatenated `self_attn.conv1d` [3 H D, 1, K] as q/k/v convolutions (Kimi-Linear's split)."""
    heads = cfg.get("linear_num_heads", cfg.get("num_attention_heads", 32))
    width = cfg.get("linear_head_dim", cfg.get("head_dim", 128))
    return kimi_linear.source_view(st, {"linear_num_heads": heads, "linear_head_dim": width})


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize,
                mtp_config=mtp_config)
