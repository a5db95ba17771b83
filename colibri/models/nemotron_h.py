"""NVIDIA Nemotron-H (`nemotron_h`: Nemotron 3 Nano 30B-A3B, Nemotron-H): every layer is one sublayer behind its
own RMSNorm (`norm`) and the residual, of the kind `layers_block_type` names (the older `hybrid_override_pattern`'s
M / * / - / E read too):

- "linear_attention": a Mamba-2 mixer (mamba2.py; in_proj / out_proj biased by `use_bias`; its group-wise gated
  norm over `n_groups` groups; prompts clamp dt from below at `time_step_min`, as transformers does);
- "full_attention": GQA without positional encoding, `head_dim` wide heads;
- "moe": routed experts without a gate, relu(up x)^2 then down (`gate_up` holds the up rows alone: kernels/moe.c
  ACT_RELU2), chosen by sigmoid score plus `e_score_correction_bias` in the `topk_group` best of `n_group` groups,
  renormalised and scaled (DeepSeek-V3's rule), beside a shared expert of the same ungated form;
- "mlp": a dense ungated relu^2 MLP.

Each layer is a `SublayerBlock` whose one module, `mixer`, answers as `self_attn` (a state or a KV cache) or as
`mlp` (the look-ahead's router) by kind. The Mamba layers' states keep prompt caching off (linear_attn.py); their
decode rows take kernels/mamba.c, the experts kernels/moe.c, layer by layer (no one-call step: its layers are not
decoder blocks). Nemotron 3 Super's latent MoE (`moe_latent_size`: the routed experts between two projections,
`LatentMoE`) runs the experts alone in the kernels.

The multi-token-prediction module (`mtp.layers.{i}`, `num_nextn_predict_layers` steps of the layers
`mtp_layers_block_type` names, transformers' default an attention layer then an MoE one; the legacy
`mtp_hybrid_override_pattern` read too) is kept (layers/mtp.py: a step of several layers, `block`, `block1`, ...):
enorm / hnorm / eh_proj on its first layer, `final_layernorm` on its last (vLLM's layout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from ..layers import native_mlp
from ..layers.attention import Attention, AttentionArgs, Positions
from ..layers.batch import LayerKV
from ..layers.kvquant import DEFAULT, KVTypes
from ..layers.layers import Linear, RMSNorm
from ..layers.linear_attn import StateCache
from ..layers.mamba2 import Mamba2Args, Mamba2Mixer
from ..layers.moe import SparseMoE, SwitchGLU, relu2
from .base import LEGACY_KINDS, BaseArgs, CausalLM, refuse
from .family import Family
from .glm4_moe import GroupLimitedRouter

NAME = "nemotron_h"
MIXERS, FFNS = ("linear_attention", "full_attention"), ("moe", "mlp")
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def layer_kinds(cfg: dict) -> list | object:
    """The config's layer list in transformers' names (`layers_block_type`, else the pattern string)."""
    kinds = cfg.get("layers_block_type", cfg.get("layer_types"))
    if kinds is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        return [_PATTERN.get(c, c) for c in cfg["hybrid_override_pattern"]]
    return [LEGACY_KINDS.get(k, k) for k in kinds] if isinstance(kinds, list) else kinds


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
               "mamba_chunk_size": "chunk_size", "mamba_dt_min": "time_step_min", "num_local_experts":
               "n_routed_experts"}

    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 131072
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 4096
    intermediate_size: int = 21504
    mlp_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_min: float = 0.001
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    layer_norm_epsilon: float = 1e-5
    moe_latent_size: int | None = None
    raw: dict | None = None


class Relu2MLP(nn.Module):
    """The ungated feed-forward of the dense layers and the shared expert: down(relu(up x)^2); bf16 decode rows of
    native weights in one call (kernels/moe.c coli_mlp_rows, ACT_RELU2: the bits of this torch form), which the MoE
    block's fused call also runs for the shared expert."""

    native_act = native.ACT_RELU2

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias)
        self.down_proj = Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_mlp.run(self, x)
        return y if y is not None else self.down_proj(F.relu(self.up_proj(x)).square())

    def _apply(self, fn, recurse: bool = True):  # moved weights: rebuild the kernel's constants
        native_mlp.forget(self)
        return super()._apply(fn, recurse)


class LatentMoE(SparseMoE):
    """Nemotron 3 Super's MoE: the router and the shared expert read the rows, the routed experts a latent
    projection of them (`fc1_latent_proj`, hidden -> `moe_latent_size`), their sum projected back (`fc2_latent_proj`).
    The kernels' MoE block has no place for the projections: the experts run alone in the kernels."""

    def __init__(self, gate: nn.Module, experts: SwitchGLU, shared: nn.Module, hidden: int, latent: int, bias: bool):
        super().__init__(gate, experts, shared, shared_name="shared_experts")
        self.fc1_latent_proj = Linear(hidden, latent, bias)
        self.fc2_latent_proj = Linear(latent, hidden, bias)

    def fused(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        idx, weights = self.gate(x)  # [T, k]
        y = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), idx, weights, resid))  # [T, H]
        return y + self.shared_experts(x)


class _NoState:
    """What a feed-forward layer keeps for a sequence: nothing (an empty state, so the slot has one cache a layer)."""

    @staticmethod
    def make_cache(max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        return StateCache(0, 2, 0, 0, 0, dtype, device)


class SublayerBlock(nn.Module):
    """h + sub(norm(h)): one Nemotron-H layer; `sub` a mixer (taking the layer's cache) or a feed-forward."""

    def __init__(self, sub: nn.Module, kind: str, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.mixer = sub
        self.kind = kind
        self.routed = isinstance(sub, SparseMoE)

    @property
    def self_attn(self):  # (the engine's per-layer cache: the mixer's, or an empty state)
        return self.mixer if self.kind in MIXERS else _NoState

    @property
    def mlp(self) -> nn.Module | None:  # (the look-ahead's router and experts)
        return self.mixer if self.kind in FFNS else None

    @property
    def post_attention_layernorm(self) -> nn.Module | None:  # (the look-ahead's norm before the router)
        return self.norm if self.kind in FFNS else None

    def forward(self, h: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if self.kind in MIXERS:
            return h + self.mixer(self.norm(h), kv)
        x = self.norm(h)
        if self.routed:
            out = self.mixer.fused(x, h)  # (router, experts, shared expert and residual in one call; else below)
            return out if out is not None else h + self.mixer(x, h)
        return h + self.mixer(x)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        H, eps = a.hidden_size, a.layer_norm_epsilon
        attn = AttentionArgs(H, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(10000.0, max_pos=a.max_position_embeddings, use_rope=False), norm_eps=eps)
        mamba = Mamba2Args(H, a.mamba_num_heads, a.mamba_head_dim, a.ssm_state_size, a.n_groups, a.conv_kernel,
                           a.chunk_size, eps, a.use_conv_bias, a.use_bias, (float(a.time_step_min), float("inf")))

        def sub(i: int, kind: str) -> nn.Module:
            if kind == "linear_attention":
                return Mamba2Mixer(mamba)
            if kind == "full_attention":
                return Attention(attn)
            if kind == "mlp":
                return Relu2MLP(H, a.intermediate_size, a.mlp_bias)
            gate = GroupLimitedRouter(H, a.n_routed_experts, a.num_experts_per_tok, a.n_group, a.topk_group,
                                      a.norm_topk_prob, a.routed_scaling_factor)
            latent = a.moe_latent_size or H
            experts = SwitchGLU(i, latent, a.moe_intermediate_size, a.n_routed_experts, act=relu2,
                                native_act=(native.ACT_RELU2, 0.0, 0.0), gated=False)
            shared = Relu2MLP(H, a.moe_shared_expert_intermediate_size, a.mlp_bias)
            if a.moe_latent_size:
                return LatentMoE(gate, experts, shared, H, latent, a.mlp_bias)
            return SparseMoE(gate, experts, shared, shared_name="shared_experts")

        kinds = layer_kinds(a.raw or {})
        super().__init__(a.vocab_size, H, eps, [SublayerBlock(sub(i, k), k, H, eps) for i, k in enumerate(kinds)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse Nemotron-H configs this file does not implement."""
    kinds = layer_kinds(cfg)
    if not isinstance(kinds, list) or not kinds or any(k not in MIXERS + FFNS for k in kinds):
        refuse(NAME, "layers_block_type", cfg.get("layers_block_type", cfg.get("hybrid_override_pattern")),
               "a list of linear_attention / full_attention / moe / mlp")
    if "moe" not in kinds:
        refuse(NAME, "layers_block_type", kinds, "at least one moe layer (colibri runs mixture-of-experts models)")
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(kinds):
        refuse(NAME, "num_hidden_layers", n, f"the {len(kinds)} layers layers_block_type lists")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            refuse(NAME, key, cfg[key], f"only {want}")
    latent = cfg.get("moe_latent_size")
    if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int) or latent < 1):
        refuse(NAME, "moe_latent_size", latent, "none or a positive integer")
    experts, groups = cfg.get("n_routed_experts", 8), cfg.get("n_group", 1)
    if not isinstance(groups, int) or groups < 1 or experts % groups or cfg.get("topk_group", 1) > groups:
        refuse(NAME, "n_group", groups, f"a divisor of n_routed_experts ({experts}), at least topk_group")
    heads, g = cfg.get("mamba_num_heads", 128), cfg.get("n_groups", cfg.get("mamba_n_groups", 8))
    if not isinstance(g, int) or g < 1 or heads % g:
        refuse(NAME, "n_groups", g, f"a divisor of mamba_num_heads ({heads})")
    k = cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        refuse(NAME, "conv_kernel", k, "an integer of at least 2 (a convolution over past inputs)")
    t = cfg.get("time_step_min", 0.001)
    if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0:
        refuse(NAME, "time_step_min", t, "a number >= 0")


_RENAMES = (("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."))


MTP = re.compile(r"(?:language_model\.)?mtp\.layers\.(\d+)\.(.+)")
MTP_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "norm"}


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the release's `backbone.` prefix, embeddings and final norm under the decoder's
    names; each layer's `norm` and `mixer` kept; the MTP module's layers as layers/mtp.py's step `mtp.0.`."""
    if m := MTP.fullmatch(name):
        role, _, rest = m[2].partition(".")
        if role in MTP_OWN:
            return f"mtp.0.{MTP_OWN[role]}.{rest}"
        return f"mtp.0.block{'' if m[1] == '0' else m[1]}.{m[2]}"
    if name.startswith("mtp.") or ".mtp." in name:
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
    return name


def mtp_config(cfg: dict) -> dict:
    """One MTP step as a model of its layers (`mtp_layers_block_type`, else the legacy pattern, else transformers'
    default: attention, then MoE)."""
    kinds = cfg.get("mtp_layers_block_type")
    if kinds is None and isinstance(cfg.get("mtp_hybrid_override_pattern"), str):
        kinds = [_PATTERN.get(c, c) for c in cfg["mtp_hybrid_override_pattern"]]
    kinds = [LEGACY_KINDS.get(k, k) for k in kinds or ["full_attention", "moe"]]
    out = {k: v for k, v in cfg.items() if k not in ("layer_types", "hybrid_override_pattern")}
    return {**out, "num_hidden_layers": len(kinds), "layers_block_type": kinds}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_config=mtp_config)
