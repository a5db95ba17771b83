"""SK Telecom's A.X K2 (`axk2`, transformers' port: A.X-K2-Light and the grouped A.X-K2 releases): DeepSeek-V3.2's
layers (deepseek_v32.py: MLA with a q LoRA, DeepSeek Sparse Attention, the sigmoid router with a selection bias, a
shared expert) with three changes:

- Gated norms: the input norm of every layer and the post-attention norm of the MoE layers are RMSNorm followed by a
  low-rank sigmoid gate, y = norm(x), y sigmoid(fc2 silu(fc1 y)) (`GatedRMSNorm`; the dense layers' post norm is
  plain).
- A gated query: one projection of [q_a_layernorm(q_a_proj x), q_a_proj x] gives each head its query and a gate
  over its output channels, the heads' output times sigmoid(gate) before o_proj (`GatedQueryAttention`).
- The router: without `n_group` (A.X-K2-Light) no groups; with them, the experts outside the kept groups score 0.0
  for the choice (DeepSeek's -inf elsewhere), so grouped routing takes torch's rule, not the kernels'.

MoE layers by `mlp_layer_types`, else from `first_k_dense_replace` (1) at every `moe_layer_freq`. Names: the
release's (`self_attn.q_b_proj` for the query-and-gate projection, the norms' `W_down` / `W_up`); transformers'
in-memory `q_gate_proj` and `mlp.fc1` / `mlp.fc2` map onto them. bf16 rows of native weights take kernels/mla.c's
block with both gates (`qgate`, `gate_rank`): the gated norms, the gated query and the output gate in the call, and
so the one-call step where V3.2's takes it (a context within `index_topk`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from ..layers.layers import Linear, RMSNorm
from . import deepseek_v3 as v3
from . import deepseek_v32 as v32
from .base import refuse, rename_first
from .family import Family

NAME = "axk2"


@dataclass
class ModelArgs(v32.ModelArgs):
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    n_routed_experts: int = 128
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 131072
    index_n_heads: int = 16
    gated_norm_rank: int = 16

    def __post_init__(self):
        self.grouped = self.n_group is not None
        if not self.grouped:  # (one group holding every expert: no group limit)
            self.n_group = self.topk_group = 1

    def is_moe(self, i: int) -> bool:
        return mlp_kinds(self.raw or {}, self.num_hidden_layers)[i] == "sparse"


def mlp_kinds(cfg: dict, n: int) -> list[str]:
    """transformers' AXK2Config rule: `mlp_layer_types`, else sparse from `first_k_dense_replace` at every
    `moe_layer_freq`."""
    if cfg.get("mlp_layer_types") is not None:
        return list(cfg["mlp_layer_types"])
    first, freq = int(cfg.get("first_k_dense_replace", 1)), int(cfg.get("moe_layer_freq", 1))
    return ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(n)]


class GatedRMSNorm(nn.Module):
    """RMSNorm, then times sigmoid(fc2 silu(fc1 y)) of its own output y (f32 sigmoid, as transformers')."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.W_down, self.W_up = Linear(hidden, rank), Linear(rank, hidden)  # (the release's names: fc1, fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.W_up(F.silu(self.W_down(y))).float())).to(y.dtype)


class GatedQueryAttention(v32.DSAttention):
    """DSA whose queries and output gates come from one projection of [q_resid, q_a_proj x] [T, H (Dq + Dv)]: the
    release's `q_b_proj` (transformers' `q_gate_proj`), here wider than MLA's and reading twice the q LoRA."""

    def __init__(self, mla, a: ModelArgs):
        super().__init__(mla, a)
        m = self.a
        self.q_b_proj = Linear(2 * m.q_lora_rank, m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim))
        self._gate: torch.Tensor | None = None  # [T, H Dv]: this forward's output gates (query -> out_gate)

    fused = v32.DSAttention.fused  # (DecoderBlock takes a class's own `fused` only)

    def _build_native_layer(self, in_norm, post_norm):
        """kernels/mla.c's block with the gated query (`qgate`) and the gated norms (`gate_rank`): the RMSNorm
        parts as V3's, the gates' low-rank weights beside them; None where a gate's weights are not native."""
        gated_post = isinstance(post_norm, GatedRMSNorm)
        if not isinstance(in_norm, GatedRMSNorm):
            return None
        layer = super()._build_native_layer(in_norm.norm, post_norm.norm if gated_post else post_norm)
        gates = (in_norm, post_norm) if gated_post else (in_norm,)
        downs, ups = [g.W_down for g in gates], [g.W_up for g in gates]
        if layer is None or not all(getattr(p, "path", None) == "native" and p.bias is None
                                    and p.compute_dtype == torch.bfloat16 for p in downs + ups) \
                or any(len({(p.scheme, p.group_size) for p in ps}) > 1 for ps in (downs, ups)):
            return None
        qw = lambda p: native.QW(*native.qw(p))  # noqa: E731
        layer.qgate, layer.gate_rank = 1, in_norm.W_down.out_features
        layer.in_gd, layer.in_gu = qw(in_norm.W_down), qw(in_norm.W_up)
        if gated_post:
            layer.post_gd, layer.post_gu = qw(post_norm.W_down), qw(post_norm.W_up)
        layer.gd_scheme, layer.gd_group = 8 if downs[0].scheme == "int8" else 4, downs[0].group_size
        layer.gu_scheme, layer.gu_group = 8 if ups[0].scheme == "int8" else 4, ups[0].group_size
        return layer

    def query(self, x: torch.Tensor) -> torch.Tensor:
        m, T = self.a, x.shape[0]
        qa = self.q_a_proj(x)  # [T, q_lora]
        qg = self.q_b_proj(torch.cat((self.q_a_layernorm(qa), qa), -1)).view(T, m.heads, -1)  # [T, H, Dq + Dv]
        Dq = m.qk_nope_head_dim + m.qk_rope_head_dim
        self._gate = qg[..., Dq:].reshape(T, -1)
        return qg[..., :Dq].reshape(T, -1)

    def out_gate(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        gate, self._gate = self._gate, None
        return (o * torch.sigmoid(gate.float())).to(o.dtype)


_RENAMES = ((".self_attn.q_gate_proj.", ".self_attn.q_b_proj."), ("layernorm.mlp.fc1.", "layernorm.W_down."),
            ("layernorm.mlp.fc2.", "layernorm.W_up."))


def sanitize(name: str) -> str | None:
    """transformers' in-memory names -> the release's (canonical here)."""
    return rename_first(name, _RENAMES)


class Router(v3.Router):
    MASKED = 0.0  # (transformers' AXK2TopkRouter masks the other groups' scores with 0.0)


class Model(v32.Model):
    router_cls = Router

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        mla = a.mla()
        for i, b in enumerate(self.model.layers):
            b.self_attn = GatedQueryAttention(mla, a)
            b.input_layernorm = GatedRMSNorm(a.hidden_size, a.gated_norm_rank, a.rms_norm_eps)
            if a.is_moe(i):
                b.post_attention_layernorm = GatedRMSNorm(a.hidden_size, a.gated_norm_rank, a.rms_norm_eps)


def check_config(cfg: dict) -> None:
    """DeepSeek-V3.2's refusals (a q LoRA, the indexer's sizes), A.X K2's layer list and groups."""
    grouped = cfg.get("n_group") is not None
    if grouped != (cfg.get("topk_group") is not None):
        refuse(NAME, "topk_group", cfg.get("topk_group"), "set together with n_group (both absent: no groups)")
    v32.check_config({**cfg, "mlp_layer_types": mlp_kinds(cfg, int(cfg.get("num_hidden_layers") or 0))}
                     | ({} if grouped else {"n_group": 1, "topk_group": 1}))
    if int(cfg.get("gated_norm_rank", 16)) < 1:
        refuse(NAME, "gated_norm_rank", cfg.get("gated_norm_rank"), "a positive rank")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
