"""Meituan's LongCat-Flash (`longcat_flash`: LongCat-Flash-Chat / -Thinking, 560B with 18.6-31.3B active): each
layer holds two sublayers and a shortcut-connected MoE (transformers' LongcatFlashDecoderLayer):

    h = h + attn0(n0(h)); x = p0(h); s = moe(x); h = h + mlp0(x)
    h = h + attn1(n1(h)); h = h + mlp1(p1(h)) + s

- attention: DeepSeek's MLA with a q LoRA (mla.py, its latent cache; RoPE rotates interleaved pairs), whose
  query and normalised latent are scaled by sqrt(hidden / q_lora_rank) and sqrt(hidden / kv_lora_rank) -- folded
  into `q_b_proj` and `kv_a_layernorm` at conversion (`prepare`); the layer's two MLA caches are one slot entry
  (`PairCache`);
- `mlp0`, `mlp1`: dense SwiGLU MLPs of `ffn_hidden_size`;
- the MoE: softmax over `n_routed_experts` + `zero_expert_num` logits, the top `moe_topk` chosen by score +
  `e_score_correction_bias`, weighted by their unbiased scores times `routed_scaling_factor` (not renormalised).
  Ids past the routed experts are *zero-computation* experts: they return their input times their weight
  (`ZeroExpertMoE`), so a token runs a varying number of real experts and reads only theirs.

The checkpoint's `mlp.router.classifier` is the MoE's gate, its norms `.0` / `.1` become `input_layernorm`,
`input_layernorm_1`, `post_attention_layernorm` (the MoE's: the look-ahead applies it),
`post_attention_layernorm_1`; the placeholder gate/up weights transformers saves for the zero experts are dropped
(`source_view`). The multi-token-prediction module (`model.mtp.*`: enorm / hnorm (`.m`), eh_proj, one DeepSeek-V2
layer -- an MLA and a dense MLP of `ffn_hidden_size`, its MLP under `transformer_layer.` --, `model.mtp.norm`, a
copy of the embedding) is kept (layers/mtp.py): `mtp_config` marks its one-layer model (`MTP_KEY`), which this file
builds as that layer. The blocks run layer by layer (not the one-call step's shape): MLA and the MLPs natively for
bf16 decode rows, the MoE in one kernels/moe.c call (coli_zero_moe: router, zero slots, experts, identity) for a
resident layer's rows, else the experts there with the router and zero slots around them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native, native_zero
from ..layers.batch import LayerKV
from ..layers.kvquant import DEFAULT, KVTypes
from ..layers.layers import MLP, DecoderBlock, RMSNorm, rope_scaling, rope_theta
from ..layers.mla import LatentCache, MLAArgs, MLAttention
from ..layers.moe import RouteRule, SparseMoE, SwitchGLU, native_route, native_router_ok, native_routing
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family

NAME = "longcat_flash"
DEFAULT_THETA = 1e7  # transformers' LongcatFlashConfig.default_theta


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"ffn_hidden_size": "intermediate_size", "expert_ffn_hidden_size": "moe_intermediate_size",
               "moe_topk": "num_experts_per_tok", "num_layers": "num_hidden_layers"}

    hidden_size: int
    num_hidden_layers: int  # (LongCat's `num_layers`: each holds two attention sublayers)
    num_attention_heads: int
    vocab_size: int = 131072
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 512
    zero_expert_num: int = 256
    num_experts_per_tok: int = 12
    routed_scaling_factor: float = 6.0
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    raw: dict | None = None

    def mla(self) -> MLAArgs:
        raw = self.raw or {}
        return MLAArgs(self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank,
                       self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, rope_theta(raw, DEFAULT_THETA),
                       rope_scaling(raw), self.max_position_embeddings, True, self.attention_bias)


class Router(nn.Module):
    """Softmax over routed + zero experts, top k by score + selection bias: `x [T, H] -> (idx, weights [T, k])`."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        E = a.n_routed_experts + a.zero_expert_num
        self.weight = nn.Parameter(torch.empty(E, a.hidden_size), requires_grad=False)  # [E + Z, H]
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)  # [E + Z]
        self.top_k, self.scaling = a.num_experts_per_tok, a.routed_scaling_factor

    def native_routing(self) -> RouteRule | None:
        """The kernels' softmax-with-bias rule (route.c, ERNIE's), not renormalised: times the scale."""
        b = self.e_score_correction_bias
        if b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous():
            return None
        return RouteRule(native.ROUTE_SOFTMAX_BIAS, False, b, float(self.scaling))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # (bf16 rows: f32 stays the oracle's)
        if routed is not None:
            return routed
        scores = torch.softmax(x.float() @ self.weight.T, dim=-1)  # [T, E + Z]
        idx = (scores + self.e_score_correction_bias).topk(self.top_k, -1).indices  # [T, k]: the bias only chooses
        return idx, scores.gather(1, idx) * self.scaling


class ZeroExpertMoE(SparseMoE):
    """Routed experts beside zero-computation ones (ids >= the routed count: y = weight * x). The experts see
    each zero slot as a repeat of its row's first real expert at weight 0 (nothing fetched or added for it; a
    row with no real expert repeats the step's first, or expert 0), so routing logs show such slots at weight 0."""

    def fused(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        return None  # (the kernels' MoE block adds a residual LongCat's shortcut does not take: `native` instead)

    def native(self, x: torch.Tensor, resid: torch.Tensor | None) -> torch.Tensor | None:
        """The layer in one native call (kernels/moe.c coli_zero_moe: the router, the zero slots, the experts, the
        identity term) for a few bf16 rows of a resident layer; None where it does not apply."""
        ex, rule = self.experts, native_routing(self.gate)
        if rule is None or x.shape[0] > native.MOE_MAX_ROWS \
                or not native_router_ok(self.gate.weight, x):
            return None
        tables = ex.source.native_tables(ex) if ex.source.holds_all(ex.layer) else None
        if tables is None:
            return None
        if resid is not None:
            ex._look_ahead(resid)  # the next layer's reads start first, as on the torch path
        out = native_zero.zero_moe(tables, x.contiguous(), self.gate.weight, ex.num_experts, self.gate.top_k,
                                   rule.norm, rule.kind, rule.bias, rule.scale, ex.intermediate)
        if out is None:
            return None
        ex.route = (out[1], out[2])
        return out[0]

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        out = self.native(x, resid)
        if out is not None:
            return out
        idx, weights = self.gate(x)  # [T, k] over routed + zero ids
        real = idx < self.experts.num_experts  # [T, k]
        ident = torch.where(real, 0.0, weights.float()).sum(-1, keepdim=True)  # [T, 1]: the zero experts' weight
        any_real = real.any(-1)  # [T]
        # the step's first real expert (row-major), else expert 0: without a host sync (the GPU tier's)
        step_first = torch.where(any_real.any(), idx.reshape(-1)[real.reshape(-1).int().argmax()], 0)
        first = idx.gather(1, real.int().argmax(-1, keepdim=True))[:, 0]  # [T]: each row's first real expert
        first = torch.where(any_real, first, step_first)
        idx = torch.where(real, idx, first[:, None])
        weights = torch.where(real, weights, torch.zeros_like(weights))
        out = self.experts(x, idx, weights, resid)  # [T, H]
        return out + (ident * x.float()).to(out.dtype)


class PairCache:
    """A layer's two MLA latent caches, one slot entry (engine/kv.py reads its positions through `parts`)."""

    POS_DIM = LatentCache.POS_DIM

    def __init__(self, pair: tuple[LatentCache, LatentCache]):
        self.pair = pair

    def parts(self) -> dict[str, torch.Tensor]:
        return {f"{j}.{k}": t for j, c in enumerate(self.pair) for k, t in c.parts().items()}

    def to(self, device: torch.device | str) -> PairCache:
        for c in self.pair:
            c.to(device)
        return self

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.pair)


class PairAttention(nn.ModuleList):
    """The layer's two MLA sublayers (`self_attn.0`, `self_attn.1`), whose caches the slot keeps as one."""

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> PairCache:
        return PairCache(tuple(m.make_cache(max_len, dtype, device, types) for m in self))

    @staticmethod
    def split(kv: LayerKV) -> tuple[LayerKV, LayerKV]:
        """The step's view for each sublayer: the same rows and positions over its own cache."""
        return tuple(LayerKV([(r0, r1, s, c.pair[j]) for r0, r1, s, c in kv.segs], kv.pos) for j in (0, 1))


class Block(nn.Module):
    """One LongCat layer (the module docstring's two sublayers and shortcut MoE)."""

    routed = True

    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        H, eps = a.hidden_size, a.rms_norm_eps
        self.self_attn = PairAttention([MLAttention(a.mla()) for _ in range(2)])
        self.mlps = nn.ModuleList([MLP(H, a.intermediate_size) for _ in range(2)])
        self.mlp = ZeroExpertMoE(Router(a), SwitchGLU(i, H, a.moe_intermediate_size, a.n_routed_experts))
        self.input_layernorm, self.input_layernorm_1 = RMSNorm(H, eps), RMSNorm(H, eps)
        self.post_attention_layernorm, self.post_attention_layernorm_1 = RMSNorm(H, eps), RMSNorm(H, eps)

    def forward(self, h: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        kv0, kv1 = self.self_attn.split(kv)
        h, x = self._attend(0, h, kv0, self.input_layernorm, self.post_attention_layernorm)
        shortcut = self.mlp(x, h)  # [T, H]: added after the second sublayer
        h = h + self.mlps[0](x)
        h, x = self._attend(1, h, kv1, self.input_layernorm_1, self.post_attention_layernorm_1)
        return h + self.mlps[1](x) + shortcut

    def _attend(self, j: int, h: torch.Tensor, kv: LayerKV, in_norm: RMSNorm, post_norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + attn_j(in_norm(h)), post_norm of that): the native MLA block where it applies."""
        attn = self.self_attn[j]
        out = attn.fused(h, kv, in_norm, post_norm)
        if out is not None:
            return out
        h = h + attn(in_norm(h), kv)
        return h, post_norm(h)


MTP_KEY = "colibri_mtp_layer"  # (set by `mtp_config` only: the model is the MTP module's one plain layer)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        H, eps = a.hidden_size, a.rms_norm_eps
        blocks = [DecoderBlock(MLAttention(a.mla()), MLP(H, a.intermediate_size), H, eps)] \
            if (a.raw or {}).get(MTP_KEY) else [Block(a, i) for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


# ----------------------------------------------------------------------------- conversion


def flat_config(cfg: dict) -> dict:
    """LongCat's `num_layers` as the `num_hidden_layers` the converter and validator count (colibri's layers are
    LongCat's: two attention sublayers each)."""
    if "num_layers" in cfg:
        return {**cfg, "num_hidden_layers": cfg["num_layers"]}
    return cfg


def check_config(cfg: dict) -> None:
    """Refuse LongCat-Flash configs this file does not implement (transformers' rules are the reference)."""
    check_act_and_rope(NAME, cfg)
    if cfg.get("router_bias"):
        refuse(NAME, "router_bias", cfg["router_bias"], "false: transformers' router ignores a classifier bias")
    if cfg.get("norm_topk_prob"):
        refuse(NAME, "norm_topk_prob", cfg["norm_topk_prob"], "false: the weights are not renormalised")
    if cfg.get("zero_expert_type", "identity") != "identity":
        refuse(NAME, "zero_expert_type", cfg["zero_expert_type"], "identity")
    if cfg.get("attention_method", "MLA") != "MLA":
        refuse(NAME, "attention_method", cfg["attention_method"], "MLA")
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if cfg.get(key) is False:
            refuse(NAME, key, False, "true: transformers always scales the LoRA outputs")
    if not cfg.get("q_lora_rank", 1536):
        refuse(NAME, "q_lora_rank", cfg.get("q_lora_rank"), "a rank > 0: queries always go through a LoRA")
    rope, nope = int(cfg.get("qk_rope_head_dim", 64)), int(cfg.get("qk_nope_head_dim", 128))
    if cfg.get("head_dim", rope) != rope:
        refuse(NAME, "head_dim", cfg["head_dim"], f"qk_rope_head_dim ({rope}): RoPE's width")
    if cfg.get("qk_head_dim") not in (None, rope + nope):
        refuse(NAME, "qk_head_dim", cfg["qk_head_dim"], f"qk_nope_head_dim + qk_rope_head_dim ({rope + nope})")
    n, z = int(cfg.get("n_routed_experts", 512)), int(cfg.get("zero_expert_num") or 0)
    if n < 1:
        refuse(NAME, "n_routed_experts", n, "at least one routed expert")
    if not 1 <= int(cfg.get("moe_topk", 12)) <= n + z:
        refuse(NAME, "moe_topk", cfg.get("moe_topk"), f"between 1 and n_routed_experts + zero_expert_num ({n + z})")


_RENAMES = ((".input_layernorm.0.", ".input_layernorm."), (".input_layernorm.1.", ".input_layernorm_1."),
            (".post_attention_layernorm.0.", ".post_attention_layernorm."),
            (".post_attention_layernorm.1.", ".post_attention_layernorm_1."),
            (".mlp.router.classifier.", ".mlp.gate."), (".mlp.router.", ".mlp.gate."))


_MTP_NAMES = (("model.mtp.layers.0.enorm.m.", "mtp.0.enorm."), ("model.mtp.layers.0.hnorm.m.", "mtp.0.hnorm."),
              ("model.mtp.layers.0.eh_proj.", "mtp.0.eh_proj."), ("model.mtp.norm.", "mtp.0.norm."),
              ("model.mtp.layers.0.transformer_layer.", "mtp.0.block."), ("model.mtp.layers.0.", "mtp.0.block."))


def sanitize(name: str) -> str | None:
    """HF name (after `source_view`) -> canonical name; the MTP module's under layers/mtp.py's `mtp.0.` (its copy
    of the embedding goes)."""
    if name.startswith("model.mtp."):
        mapped = rename_first(name, _MTP_NAMES)
        return None if mapped == name else mapped
    return rename_first(name, _RENAMES)


def mtp_config(cfg: dict) -> dict:
    """The MTP module's layer as a one-layer model (`MTP_KEY`: built as an MLA and a dense MLP, not LongCat's
    layer)."""
    return {**cfg, "num_layers": 1, "num_hidden_layers": 1, MTP_KEY: True}


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """MLA's LoRA scales folded in (f32): q_b_proj times sqrt(H / q_lora_rank), kv_a_layernorm's weight times
    sqrt(H / kv_lora_rank) (the normalised latent is what the cache keeps)."""
    H = float(cfg["hidden_size"])
    if name.endswith(".q_b_proj.weight"):
        factor = math.sqrt(H / cfg.get("q_lora_rank", 1536))
    elif name.endswith(".kv_a_layernorm.weight"):
        factor = math.sqrt(H / cfg.get("kv_lora_rank", 512))
    else:
        return t
    return (t.float() * factor).to(t.dtype)


_ZERO_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


class _RoutedOnly:
    """The checkpoint without the zero experts' weights: transformers gives them gate/up tensors (per expert, or
    the first axis of the fused gate_up_proj past `n_routed_experts`) that its forward never reads."""

    def __init__(self, st, cfg: dict):
        self._st, self._n = st, int(cfg.get("n_routed_experts", 512))

    def names(self) -> list[str]:
        return [n for n in self._st.names() if not ((m := _ZERO_EXPERT.search(n)) and int(m.group(1)) >= self._n)]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._st.shape(name))
        if name.endswith(".mlp.experts.gate_up_proj") and shape and shape[0] > self._n:
            return (self._n, *shape[1:])
        return shape

    def __getattr__(self, attr: str):
        return getattr(self._st, attr)


def source_view(st, cfg: dict):
    """The safetensors folder as `sanitize` and the converter expect it (see `_RoutedOnly`)."""
    return _RoutedOnly(st, cfg)


# (one MTP layer: the release's config does not count it)
FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, flat_config=flat_config, source_view=source_view,
                sanitize=sanitize, prepare=prepare, mtp_layers=1, mtp_config=mtp_config)
