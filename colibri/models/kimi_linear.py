"""Moonshot's Kimi-Linear (`kimi_linear`: Kimi-Linear-48B-A3B-Base / -Instruct): Kimi Delta Attention layers
(kda.py: gated delta rule with a decay per key channel, a fixed state) and MLA layers without positional encoding
(DeepSeek's latent attention, the rope part of the key kept but never rotated), over DeepSeek-V3's MoE (sigmoid router
with a selection bias in groups, renormalised, scaled; a shared expert) after the dense first layers.

- Layer kinds: `layer_types`, else the released `linear_attn_config`'s 1-indexed `kda_layers` / `full_attn_layers`,
  else transformers' default (full attention in every fourth layer past the first). Dense or MoE: `mlp_layer_types`,
  else the first `first_k_dense_replace` (default 1) dense.
- The released config's own names (`num_experts`, `num_experts_per_token`, `moe_renormalize`, `num_expert_group`,
  `num_shared_experts`, `model_max_length`, and `linear_attn_config`'s `head_dim`, `num_heads`,
  `short_conv_kernel_size`) read as transformers' attribute map does.
- Names: the checkpoint's `self_attn.{f_a,f_b}_proj` / `dt_bias` / `A_log` (transformers' in-memory
  `self_attn.forget_gate.*`), its three `{q,k,v}_conv1d` (transformers' concatenated `conv1d`, read as three by
  `source_view`), `block_sparse_moe` as `mlp`.

The KDA states keep prompt caching off. The MLA layers take kernels/mla.c's block (a RoPE of zero frequencies: cos 1,
sin 0, the identity); the KDA layers run in torch, f32; the MoE layers in kernels/moe.c.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..convert.safetensors_reader import SplitRows
from ..layers.kda import KDAArgs, KimiDeltaAttention
from ..layers.layers import MLP, DecoderBlock
from ..layers.mla import MLAArgs, MLAttention
from . import deepseek_v3 as v3
from .base import CausalLM, check_act_and_rope, refuse, rename_first
from .deepseek_v2 import moe_block
from .family import Family

NAME = "kimi_linear"
KINDS = ("linear_attention", "full_attention")


@dataclass
class ModelArgs(v3.ModelArgs):
    aliases = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
               "num_experts_per_token": "num_experts_per_tok", "moe_renormalize": "norm_topk_prob",
               "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
               "model_max_length": "max_position_embeddings"}

    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        lin = (self.raw or {}).get("linear_attn_config") or {}
        self.linear_head_dim = lin.get("head_dim", self.linear_head_dim)
        self.linear_num_heads = lin.get("num_heads", self.linear_num_heads)
        self.linear_conv_kernel_dim = lin.get("short_conv_kernel_size", self.linear_conv_kernel_dim)

    def kind(self, i: int) -> str:
        return layer_kinds(self.raw or {}, self.num_hidden_layers)[i]

    def is_moe(self, i: int) -> bool:
        kinds = self.mlp_layer_types or ["dense" if j < self.first_k_dense_replace else "sparse"
                                         for j in range(self.num_hidden_layers)]
        return self.n_routed_experts > 0 and kinds[i] == "sparse"

    def mla(self) -> MLAArgs:  # (NoPE: no RoPE scaling to fold into the softmax scale)
        return MLAArgs(self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank,
                       self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, 10000.0, None,
                       self.max_position_embeddings, False, self.attention_bias)


def layer_kinds(cfg: dict, n_layers: int) -> list:
    """Per layer "linear_attention" or "full_attention", with transformers' precedence (module docstring)."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    lin = cfg.get("linear_attn_config") or {}
    if "full_attn_layers" in lin and "kda_layers" in lin:
        kinds: list = [None] * n_layers
        for i in lin["full_attn_layers"]:
            kinds[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            kinds[i - 1] = "linear_attention"
        return kinds
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]


class NoPEMLAttention(MLAttention):
    """MLA whose rope part is never rotated: a RoPE of zero frequencies (cos 1, sin 0), also in the native block."""

    fused = MLAttention.fused  # (DecoderBlock takes a class's own `fused` only)

    def __init__(self, a: MLAArgs):
        super().__init__(a)
        self.rope.inv_freq.zero_()


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        blocks = []
        for i in range(a.num_hidden_layers):
            if a.kind(i) == "linear_attention":
                attn = KimiDeltaAttention(KDAArgs(a.hidden_size, a.linear_num_heads, a.linear_head_dim,
                                                  a.linear_conv_kernel_dim, a.rms_norm_eps))
            else:
                attn = NoPEMLAttention(a.mla())
            mlp = moe_block(a, i, v3.Router(a)) if a.is_moe(i) else MLP(a.hidden_size, a.intermediate_size)
            blocks.append(DecoderBlock(attn, mlp, a.hidden_size, a.rms_norm_eps))
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def check_layers(family: str, cfg: dict, kinds_of) -> None:
    """The refusals the KDA hybrids share (this one and Ling's): the activation and RoPE, the attention kinds
    (`kinds_of(cfg, n)`), the MLP kinds, router groups that divide the experts."""
    check_act_and_rope(family, cfg)
    n = cfg.get("num_hidden_layers")
    kinds = kinds_of(cfg, n) if isinstance(n, int) and n > 0 else None
    if kinds is not None and (len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(family, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    mlp = cfg.get("mlp_layer_types")
    if mlp is not None and (not isinstance(mlp, list) or len(mlp) != n or any(k not in ("dense", "sparse")
                                                                              for k in mlp)):
        refuse(family, "mlp_layer_types", mlp, f"{n} entries of dense / sparse")
    n_exp = next((cfg[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in cfg), 0)
    groups = next((cfg[k] for k in ("num_expert_group", "n_group") if k in cfg), 1) or 1
    if n_exp and n_exp % groups:
        refuse(family, "n_group", groups, f"a divisor of the {n_exp} experts")


def check_config(cfg: dict) -> None:
    """Refuse Kimi-Linear configs this file does not implement (transformers' port is the reference)."""
    check_layers(NAME, cfg, layer_kinds)
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        refuse(NAME, "moe_router_activation_func", cfg["moe_router_activation_func"], "sigmoid")
    lin = cfg.get("linear_attn_config") or {}
    if lin.get("num_heads", cfg.get("linear_num_heads", 32)) < 1 or lin.get("head_dim", cfg.get("linear_head_dim",
                                                                                               128)) < 1:
        refuse(NAME, "linear_attn_config", lin, "heads and a head width of at least 1")
    if lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)) < 2:
        refuse(NAME, "linear_conv_kernel_dim", cfg.get("linear_conv_kernel_dim"), "a kernel of at least 2 taps")


_RENAMES = ((".self_attn.forget_gate.", ".self_attn."), (".block_sparse_moe.", ".mlp."))


def sanitize(name: str) -> str | None:
    """HF name (after `source_view`) -> canonical name."""
    return rename_first(name, _RENAMES)


def source_view(st, cfg: dict):
    """transformers' concatenated `self_attn.conv1d` [3 H D, 1, K] as the checkpoint's q/k/v_conv1d."""
    lin = cfg.get("linear_attn_config") or {}
    HD = lin.get("num_heads", cfg.get("linear_num_heads", 32)) * lin.get("head_dim", cfg.get("linear_head_dim", 128))
    split = {}
    for n in st.names():
        if n.endswith(".self_attn.conv1d.weight"):
            for j, part in enumerate(("q", "k", "v")):
                split[n.replace(".conv1d.", f".{part}_conv1d.")] = (n, j * HD, (j + 1) * HD)
    return SplitRows(st, split) if split else st


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize)
