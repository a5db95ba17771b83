"""Google's Gemma 4 MoE text model (`gemma4_text`; the released multimodal `gemma4`, gemma-4-26B-A4B, converts to it):

- Embedding: times sqrt(hidden), the factor rounded to the checkpoint's dtype as transformers does (folded into the
  stored table by `prepare`; a tied head keeps the unscaled table).
- Attention: per-head q/k RMSNorm, the values RMS-normed without a weight, scores unscaled (1.0). Sliding layers
  (`layer_types`) attend over `sliding_window` positions with their head width and KV heads; full layers have their
  own (`per_layer_config`, or the older `global_head_dim` / `num_global_key_value_heads`), and with
  `attention_k_eq_v` no v_proj: the values are k_proj's output before k_norm. RoPE per layer type: "default" over the
  whole head, or "proportional" (full layers): the first `partial_rotary_factor` of a head's frequencies, the rest 0.
- Norms around each sublayer: o_proj's output is normed (`post_attention_layernorm`, `self_attn.out_norm` here);
  the feed-forward half of every layer is a dense GELU(tanh)-gated MLP beside the routed experts, each normed before
  and after, summed and normed again: h + out(post1(mlp(pre(h))) + post2(experts(pre2(h)))). The router reads h
  itself: a weightless RMSNorm, times a per-channel `scale` and hidden^-0.5, softmax, the top k renormalised, times
  a `per_expert_scale`.
- Each layer's output times its `layer_scalar`; the logits soft-capped by tanh (`final_logit_softcapping`).

It runs layer by layer: the attention in the kernels' attention block (keys as values and the values' norm there
too), the dense MLP in one native call and the experts in the kernels' MoE call, both with a GELU(tanh) activation,
the router's softmax rule in the kernels on bf16 rows; the norms between them in torch. Per-layer embeddings (Gemma 4
E2B / E4B), shared KV layers and bidirectional attention are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, native_block
from ..layers import native_mlp
from ..layers.attention import Attention, AttentionArgs, Output, Positions, QKNorm, Scores
from ..layers.batch import LayerKV
from ..layers.layers import MLP, DecoderBlock, RMSNorm
from ..layers.moe import RouteRule, SparseMoE, SwitchGLU, native_route
from ..layers.norms import NoNorm, rms_norm
from .base import BaseArgs, CausalLM, SoftCapped, refuse, text_model_name
from .family import Family

NAME = "gemma4_text"
KINDS = ("sliding_attention", "full_attention")
ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
ACT = "gelu_pytorch_tanh"
# the multimodal release's towers, which the converter drops (images and audio are not supported)
_OTHER_MODALITIES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                     "model.multi_modal_projector.")


@dataclass
class ModelArgs(BaseArgs):
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    sliding_window: int = 512
    layer_types: list | None = None
    final_logit_softcapping: float | None = None
    attention_k_eq_v: bool = False
    num_experts: int = 0
    top_k_experts: int = 1
    moe_intermediate_size: int = 0
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict | None = None
    raw: dict | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' pattern: five sliding layers, then a full one
            self.layer_types = [KINDS[(i + 1) % 6 == 0] for i in range(n)]
        self.layer_types = [*self.layer_types[:-1], "full_attention"]  # (transformers forces the last one full)

    def rope(self, kind: str) -> dict:
        return ((self.raw or {}).get("rope_parameters") or ROPE_DEFAULTS)[kind]

    def layer(self, i: int) -> tuple[int, int]:
        """Layer i's (head width, KV heads)."""
        per = self.per_layer_config
        if per is None:  # a config from before per_layer_config: transformers' derivation from the global fields
            kv = self.num_global_key_value_heads if self.attention_k_eq_v else None
            per = {j: {"head_dim": self.global_head_dim, **({"num_key_value_heads": kv} if kv else {})}
                   for j, kind in enumerate(self.layer_types) if kind == "full_attention"}  # type: ignore[arg-type]
        over = per.get(i, per.get(str(i), {}))
        return int(over.get("head_dim", self.head_dim)), int(over.get("num_key_value_heads", self.num_key_value_heads))


class WeightlessRMSNorm(nn.Module):
    """Gemma's RMSNorm without a scale (the values' norm; the router's input norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.register_buffer("weight", torch.ones(dim), persistent=False)  # (nothing to load)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Gemma4Attention(Attention):
    """Attention with per-head q/k norms, weightless RMS-normed values and, with `k_eq_v`, k_proj's output as the
    values; RoPE "proportional" where `rope` says so (module docstring)."""

    def __init__(self, a: AttentionArgs, k_eq_v: bool, rope: dict):
        super().__init__(a)
        self.k_eq_v = k_eq_v
        if k_eq_v:
            del self.v_proj
        self.v_norm = WeightlessRMSNorm(a.head_dim, a.norm_eps)
        if rope["rope_type"] == "proportional":  # rotate-half pairs over the whole head; only the first frequencies
            angles = int(float(rope.get("partial_rotary_factor", 1.0)) * a.head_dim // 2)
            self.rope.inv_freq[angles:] = 0.0
            self.rope.inv_freq /= float(rope.get("factor", 1.0))

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        a, T = self.a, x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, a.heads, a.head_dim))  # [T, H, D]
        k = self.k_proj(x).view(T, a.kv_heads, a.head_dim)  # [T, Hkv, D]
        v = self.v_norm(k if self.k_eq_v else self.v_proj(x).view(T, a.kv_heads, a.head_dim))
        k = self.k_norm(k)
        return self.attend(self.rope(q, kv.pos), self.rope(k, kv.pos), v, kv, x)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm):
        """Attention.fused: kernels/block.c with keys as values and the values' norm (`_build_native_layer`)."""
        return super().fused(h, kv, in_norm, post_norm)

    def _build_native_layer(self, in_norm, post_norm):
        layer = super()._build_native_layer(in_norm, post_norm)
        if layer is not None:
            layer.values = native_block.ref(native_block.AttnValues(self.v_dim, self.a.values.v_scale, int(self.k_eq_v),
                                                                    self.v_norm.weight.data_ptr()))
        return layer


class GeluMLP(MLP):
    """The dense half of a layer's feed-forward: GELU(tanh)-gated (bf16 decode rows in one native call, as MLP's)."""

    native_act = native.ACT_GELU_TANH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = native_mlp.run(self, x)
        return y if y is not None else self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def gelu_glu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Router(nn.Module):
    """The router of the module docstring, in f32: (idx [T, k], weights [T, k])."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H]
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)  # [H]
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)  # [E]
        self.norm = WeightlessRMSNorm(hidden, eps)
        self.top_k, self.root = top_k, hidden**-0.5

    def native_routing(self) -> RouteRule:
        """The kernels' softmax rule (the top k renormalised) over the rows `forward` normed and scaled (this router
        is never a fused MoE block's: that would hand it the raw rows)."""
        return RouteRule(native.ROUTE_SOFTMAX, True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.bfloat16:  # (in x's dtype as transformers scales it; f32 stays the oracle's torch path)
            routed = native_route(self, self.norm(x) * self.scale.to(x.dtype) * self.root)
            if routed is not None:
                idx, weights = routed
                return idx, weights * self.per_expert_scale.float()[idx]
        h = self.norm(x.float()) * self.scale.float() * self.root
        probs = torch.softmax(h @ self.weight.float().T, dim=-1)  # [T, E]
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * self.per_expert_scale.float()[idx]


class FeedForward(SparseMoE):
    """The dense MLP and the routed experts side by side, each between its own norms, summed and normed (module
    docstring); fed the residual itself (the block's post-attention norm is none: each half norms its input)."""

    def __init__(self, a: ModelArgs, layer: int):
        H, eps = a.hidden_size, a.rms_norm_eps
        super().__init__(Router(H, a.num_experts, a.top_k_experts, eps),
                         SwitchGLU(layer, H, a.moe_intermediate_size, a.num_experts, act=gelu_glu,
                                   native_act=(native.ACT_GELU_TANH, 0.0, 0.0)))
        self.dense = GeluMLP(H, a.intermediate_size)
        self.pre_norm, self.dense_norm, self.experts_in_norm, self.experts_norm, self.out_norm = (
            RMSNorm(H, eps) for _ in range(5))

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        dense = self.dense_norm(self.dense(self.pre_norm(x)))
        idx, weights = self.gate(x)
        routed = self.experts_norm(self.experts(self.experts_in_norm(x), idx, weights, resid))
        return self.out_norm(dense + routed)


class Block(DecoderBlock):
    """A decoder layer: the pre-norm block (no post-attention norm: the feed-forward norms its own inputs), its
    output times `layer_scalar`."""

    def __init__(self, attn: Gemma4Attention, mlp: FeedForward, hidden: int, eps: float):
        super().__init__(attn, mlp, hidden, eps)
        self.post_attention_layernorm = NoNorm()
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, h: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        out = super().forward(h, kv)
        return out * self.layer_scalar.to(out.dtype)


class Model(SoftCapped, CausalLM):
    def __init__(self, a: ModelArgs):
        def block(i: int) -> Block:
            kind = a.layer_types[i]  # type: ignore[index]
            head_dim, kv_heads = a.layer(i)
            rope = a.rope(kind)
            window = a.sliding_window if kind == "sliding_attention" else None
            attn = AttentionArgs(a.hidden_size, a.num_attention_heads, kv_heads, head_dim,
                                 Positions(float(rope["rope_theta"]), None, a.max_position_embeddings),
                                 qk_norm=QKNorm.HEAD, norm_eps=a.rms_norm_eps,
                                 scores=Scores(scale=1.0, sliding_window=window), output=Output(out_norm=True))
            return Block(Gemma4Attention(attn, a.attention_k_eq_v and kind == "full_attention", rope),
                         FeedForward(a, i), a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a



def check_config(cfg: dict) -> None:
    """Refuse Gemma 4 configs this file does not implement (module docstring)."""
    if not cfg.get("enable_moe_block"):
        refuse(NAME, "enable_moe_block", cfg.get("enable_moe_block"), "colibri runs the MoE Gemma 4 only")
    for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        v = cfg.get(field)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            refuse(NAME, field, v, "a positive integer")
    if cfg["top_k_experts"] > cfg["num_experts"]:
        refuse(NAME, "top_k_experts", cfg["top_k_experts"], f"at most num_experts={cfg['num_experts']}")
    if cfg.get("hidden_size_per_layer_input", 256):  # (transformers' default is 256: Gemma 4 E2B / E4B)
        refuse(NAME, "hidden_size_per_layer_input", cfg.get("hidden_size_per_layer_input", 256),
               "0: per-layer embeddings are not implemented")
    for field, ok, want in (("num_kv_shared_layers", (0, None), "0: shared KV layers are not implemented"),
                            ("use_bidirectional_attention", (None, "vision"), "causal text attention"),
                            ("hidden_activation", (ACT, None), ACT), ("attention_bias", (False, None), "no biases")):
        if cfg.get(field) not in ok:
            refuse(NAME, field, cfg[field], want)
    n = int(cfg.get("num_hidden_layers") or 30)
    kinds = cfg.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    rope = cfg.get("rope_parameters") or ROPE_DEFAULTS
    for kind in KINDS:
        r = rope.get(kind) if isinstance(rope, dict) else None
        if not isinstance(r, dict) or r.get("rope_type") not in ("default", "proportional") \
                or not isinstance(r.get("rope_theta"), int | float):
            refuse(NAME, f"rope_parameters.{kind}", r, 'a "default" or "proportional" rope_type with a rope_theta')
    per = cfg.get("per_layer_config")
    if per is not None and (not isinstance(per, dict) or any(
            not str(i).isdigit() or int(i) >= n or not isinstance(o, dict)
            or any(k not in ("head_dim", "num_key_value_heads") or isinstance(v, bool) or not isinstance(v, int)
                   or v < 1 for k, v in o.items()) for i, o in per.items())):
        refuse(NAME, "per_layer_config", per, "layer index -> positive head_dim / num_key_value_heads")
    a = ModelArgs.from_dict(cfg)
    for i in range(n):
        if a.num_attention_heads % a.layer(i)[1]:
            refuse(NAME, "num_key_value_heads", a.layer(i)[1], f"a divisor of {a.num_attention_heads} (layer {i})")


_RENAMES = ((".post_attention_layernorm.", ".self_attn.out_norm."),
            (".pre_feedforward_layernorm_2.", ".mlp.experts_in_norm."),
            (".post_feedforward_layernorm_1.", ".mlp.dense_norm."),
            (".post_feedforward_layernorm_2.", ".mlp.experts_norm."),
            (".pre_feedforward_layernorm.", ".mlp.pre_norm."), (".post_feedforward_layernorm.", ".mlp.out_norm."),
            (".mlp.", ".mlp.dense."), (".router.proj.", ".mlp.gate."), (".router.", ".mlp.gate."),
            (".experts.", ".mlp.experts."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the multimodal release's text model moves up and its other towers go; each layer's
    feed-forward parts gather under `mlp` (module docstring)."""
    if name.startswith(_OTHER_MODALITIES):
        return None
    name = text_model_name(name)
    if name is None or ".layers." not in name:
        return name
    for old, new in _RENAMES:  # (the first match only: `.mlp.` is the dense MLP's own prefix)
        if old in name:
            return name.replace(old, new, 1)
    return name


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The embedding times sqrt(hidden), the factor in the checkpoint's dtype as transformers multiplies it."""
    if name != "model.embed_tokens.weight":
        return t
    scale = torch.tensor(float(cfg["hidden_size"]) ** 0.5).to(t.dtype).float()
    return (t.float() * scale).to(t.dtype)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, prepare=prepare)
