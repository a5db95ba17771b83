"""Reflection AI's Beam (`beam`: Beam-1.0-501B-A23B, transformers' port). AFMoE's layout (models/afmoe.py: norms on
both sides of each sublayer, the gated attention with q/k norms per head, sliding layers with RoPE and full ones
without) with these differences:

- the output gate has a bias a head (`self_attn.gate_bias`): sigmoid(gate_proj x + b_h) times the heads' output;
- the full layers (no RoPE) scale their queries by (1 + (pos + 1) / 2048)^0.1 after the q norm ("scalable
  softmax"): one f32 table a model, which the torch layer and the kernels' block read alike;
- depth-scaled residual adds: the m-th add (m = 2, 3, ... over the sublayers) is h·sqrt((m-1)/m) + o/sqrt(m). That
  is a plain sum g = sqrt(m)·h of the sublayers' outputs, and RMSNorm(g / c) is RMSNorm(g) with eps·c²: so the
  blocks run the usual `h + o`, and each norm reading the stream (both input norms of a layer, the final norm) has
  its eps times the depth it reads at. Nothing else reads the stream, so no kernel knows of it;
- `mlp_layer_types`: "dense" layers (SwiGLU, `intermediate_size`) and "sparse" ones (DeepSeek-V3's grouped
  sigmoid router with a selection bias, renormalised, times `routed_scaling_factor`; no shared expert);
- the logits soft-capped, tanh(z / c)·c (`final_logit_softcapping`).

At int8 / int4 on the CPU the kernels run all of it (coli_attn_gate's `bias`, coli_attn_positions' temperature
table), the one-call step included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from ..format.validate import is_number
from ..kernels import native_block
from ..layers.attention import AttentionArgs, OutGate, Output, Positions, QKNorm
from ..layers.batch import LayerKV
from ..layers.layers import MLP, DecoderBlock, RMSNorm, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU
from . import deepseek_v3
from .afmoe import source_view  # noqa: F401  (gate_proj's rows inside q_proj, as AFMoE's)
from .base import BaseArgs, CausalLM, SoftCapped, check_act_and_rope, refuse, rename_first
from .family import Family
from .qwen3_next import GatedAttention

NAME = "beam"
KINDS = ("full_attention", "sliding_attention")
MLP_KINDS = ("dense", "sparse")
SSMAX_SPAN = 2048.0  # transformers' compute_attention_scaling: (1 + (pos + 1) / 2048) ** 0.1
TABLE_POSITIONS = 1 << 20  # the query-scale table's reach; past it the torch layer computes the formula


def query_scale(m: torch.Tensor) -> torch.Tensor:
    """The NoPE layers' query scale at m = pos + 1 (f32), with transformers' ops."""
    return torch.exp(0.1 * torch.log1p(m.float() / SSMAX_SPAN))


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 20480
    moe_intermediate_size: int = 2560
    num_key_value_heads: int = 8  # (transformers' default, not the heads' count)
    head_dim: int = 128
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    sliding_window: int = 512
    layer_types: list | None = None
    mlp_layer_types: list | None = None
    final_logit_softcapping: float | None = 30.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    raw: dict | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # every sixth layer full, and the last
            self.layer_types = [KINDS[bool((i + 1) % 6)] for i in range(n)]
            self.layer_types[-1] = "full_attention"
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        if (self.raw or {}).get("final_logit_softcapping", 30.0) is None:  # (None is "no cap", not the default)
            self.final_logit_softcapping = None

    def rope(self, kind: str) -> dict | None:
        """The layer kind's RoPE parameters; None: no RoPE (transformers' default for the full layers)."""
        params = (self.raw or {}).get("rope_parameters")
        if params is None or not all(k in KINDS for k in params):  # (absent, or one flat dict)
            params = {"sliding_attention": params or {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": None}
        return params.get(kind)


class BeamAttention(GatedAttention):
    """AFMoE's gated attention with a bias a head on the gate and, given `table`, the NoPE layers' query scale."""

    def __init__(self, a: AttentionArgs, table: torch.Tensor | None):
        super().__init__(a)
        self.gate_bias = nn.Parameter(torch.zeros(a.heads), requires_grad=False)  # [H]
        self.has_table = table is not None
        if table is not None:  # (one tensor for every layer: the model's)
            self.register_buffer("temp", table, persistent=False)  # [P] f32, entry m = pos + 1

    def scaled_queries(self, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if not self.has_table:
            return q
        T = q.shape[0]
        pos = (torch.arange(kv.pos, kv.pos + T) if isinstance(kv.pos, int) else kv.pos).to(q.device)  # [T]
        m = pos + 1
        # the table on the CPU where it reaches (the kernels' values); elsewhere, or past it, the formula, the same f32
        # ops (no host sync off the CPU)
        scale = self.temp[m] if q.device.type == "cpu" and int(m.max()) < self.temp.shape[0] else query_scale(m)
        return (q * scale[:, None, None]).to(q.dtype)

    def gate_logits(self, gate: torch.Tensor) -> torch.Tensor:
        return gate + self.gate_bias.to(gate.dtype).repeat_interleave(self.a.head_dim)  # (bf16 + bf16: one rounding)

    def pos_limit(self) -> int:
        """Positions below this have a table entry (the native block's and the one-call step's limit)."""
        return self.temp.shape[0] - 1 if self.has_table else 1 << 62

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if kv.end > self.pos_limit() else super().fused(h, kv, in_norm, post_norm)

    def _build_native_layer(self, in_norm, post_norm):
        layer = super()._build_native_layer(in_norm, post_norm)
        if layer is None:
            return None
        bias = self.gate_bias.to(torch.bfloat16).repeat_interleave(self.a.head_dim).contiguous()  # [H·D]
        gate = native_block.AttnGate(OutGate.Q_SIGMOID, bias=bias.data_ptr())
        gate.tensors = (bias,)  # the bias its pointer reads, alive as long as the struct
        layer.gate = native_block.ref(gate)
        if self.has_table:  # m = floor((pos + 1) / 1): an entry a position
            temp = native_block.AttnPositions(temp=self.temp.data_ptr(), temp_n=self.temp.shape[0], temp_floor=1.0)
            layer.positions = native_block.ref(temp)
        return layer


class Model(SoftCapped, CausalLM):
    def __init__(self, a: ModelArgs):
        n, eps = a.num_hidden_layers, a.rms_norm_eps
        base = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(10000.0, None, a.max_position_embeddings), qk_norm=QKNorm.HEAD, norm_eps=eps,
                             output=Output(out_norm=True))
        router = SimpleNamespace(n_routed_experts=a.num_experts, hidden_size=a.hidden_size, n_group=a.n_group,
                                 topk_group=a.topk_group, num_experts_per_tok=a.num_experts_per_tok,
                                 routed_scaling_factor=a.routed_scaling_factor, norm_topk_prob=a.norm_topk_prob)
        table = query_scale(torch.arange(max(a.max_position_embeddings, TABLE_POSITIONS) + 1))  # [P]

        def block(i: int) -> DecoderBlock:
            kind, rope = a.layer_types[i], a.rope(a.layer_types[i])
            positions = dataclasses.replace(base.positions, use_rope=rope is not None)
            if rope is not None:
                params = {"rope_parameters": rope}
                positions = dataclasses.replace(positions, rope_theta=rope_theta(params),
                                                rope_scaling=rope_scaling(params))
            window = a.sliding_window if kind == "sliding_attention" else None
            args = dataclasses.replace(base, positions=positions,
                                       scores=dataclasses.replace(base.scores, sliding_window=window))
            attn = BeamAttention(args, None if rope is not None else table)
            if a.mlp_layer_types[i] == "dense":
                mlp = MLP(a.hidden_size, a.intermediate_size, out_norm_eps=eps)
            else:
                mlp = SparseMoE(deepseek_v3.Router(router),
                                SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts), None,
                                out_norm=RMSNorm(a.hidden_size, eps))
            b = DecoderBlock(attn, mlp, a.hidden_size, eps)
            # the depth-scaled adds (module docstring): the stream read at depth c = 2i + 1, then 2i + 2
            b.input_layernorm.eps, b.post_attention_layernorm.eps = eps * (2 * i + 1), eps * (2 * i + 2)
            return b

        super().__init__(a.vocab_size, a.hidden_size, eps, [block(i) for i in range(n)])
        self.model.norm.eps = eps * (2 * n + 1)
        self.args = a



def check_config(cfg: dict) -> None:
    """Refuse Beam configs this file does not implement (module docstring)."""
    check_act_and_rope(NAME, cfg)
    n = cfg.get("num_hidden_layers")
    for key, kinds in (("layer_types", KINDS), ("mlp_layer_types", MLP_KINDS)):
        v = cfg.get(key)
        if v is not None and (len(v) != n or any(k not in kinds for k in v)):
            refuse(NAME, key, v, f"{n} entries of {' / '.join(kinds)}")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and all(k in KINDS for k in params):
        for p in params.values():
            if p is not None:
                check_act_and_rope(NAME, {"rope_parameters": p}, act=False)
    if cfg.get("attention_bias"):
        refuse(NAME, "attention_bias", True, "no q/k/v/o biases, as released")
    experts, group, keep = cfg.get("num_experts", 256), cfg.get("n_group", 8), cfg.get("topk_group", 4)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or experts % group:
        refuse(NAME, "n_group", group, f"a divisor of num_experts={experts}")
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= group:
        refuse(NAME, "topk_group", keep, f"1 to n_group={group}")
    if keep * (experts // group) < cfg.get("num_experts_per_tok", 8):
        refuse(NAME, "topk_group", keep, "enough kept groups for num_experts_per_tok experts")
    scale, cap = cfg.get("routed_scaling_factor", 2.5), cfg.get("final_logit_softcapping", 30.0)
    if not is_number(scale) or scale <= 0:
        refuse(NAME, "routed_scaling_factor", scale, "a number > 0")
    if cap is not None and (not is_number(cap) or cap <= 0):
        refuse(NAME, "final_logit_softcapping", cap, "a number > 0, or null")
    window = cfg.get("sliding_window", 512)
    if "sliding_attention" in (cfg.get("layer_types") or ["sliding_attention"]) \
            and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        refuse(NAME, "sliding_window", window, "a window of at least 1 for the sliding layers")


# transformers' names -> ours: the attention output's norm is `self_attn.out_norm`, the MLP's input norm our
# `post_attention_layernorm`, its output's `mlp.out_norm` (AFMoE's places)
_RENAMES = ((".post_attention_layernorm.", ".self_attn.out_norm."),
            (".pre_feedforward_layernorm.", ".post_attention_layernorm."),
            (".post_feedforward_layernorm.", ".mlp.out_norm."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name (each at most one rename: the released norms swap places with ours)."""
    return rename_first(name, _RENAMES)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize)
