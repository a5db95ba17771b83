"""Arcee's AFMoE (`afmoe`: Trinity Nano / Mini / Large). Llama-like layers with these differences:

- norms on both sides of each sublayer: h + norm(attn(norm(h))), then h + norm(mlp(norm(h))). The released
  `post_attention_layernorm` is the attention output's norm (`self_attn.out_norm` here), `pre_mlp_layernorm` the
  MLP input's (`post_attention_layernorm` here), `post_mlp_layernorm` the MLP output's (`mlp.out_norm`);
- gated attention: the heads' output times sigmoid(gate_proj(x)) before o_proj; q/k RMSNorm per head. The
  converter interleaves gate_proj's rows into q_proj's, each head's query then its gate (`source_view`), the
  layout of Qwen3-Next's gated attention, whose module and kernels run it;
- `layer_types`: sliding layers (RoPE, `sliding_window`) and full layers without RoPE (by default every
  `global_attn_every_n_layers`-th layer is full);
- the first `num_dense_layers` layers dense; the rest routed by sigmoid scores with a selection bias
  (`expert_bias`), renormalised, times `route_scale` (DeepSeek-V3's router with one group), beside a shared
  expert `num_shared_experts` experts wide;
- `mup_enabled`: the embedding times sqrt(hidden_size), stored so (`prepare`).

At int8 / int4 on the CPU the kernels run all of it: the attention block and the MoE block take each sublayer's
output norm (coli_attn_output.norm_w, coli_moe_block's out_w), and so does the one-call step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..convert.safetensors_reader import SplitRows
from ..errors import ColibriError
from ..format.validate import is_number
from ..layers.attention import AttentionArgs, Output, Positions, QKNorm
from ..layers.layers import MLP, DecoderBlock, RMSNorm, rope_scaling, rope_theta
from ..layers.moe import SparseMoE, SwitchGLU
from . import deepseek_v3
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family
from .qwen3_next import GatedAttention

NAME = "afmoe"
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 6144
    moe_intermediate_size: int = 1408
    num_dense_layers: int = 1
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_experts: int = 64
    num_experts_per_tok: int = 6
    num_shared_experts: int = 2
    route_scale: float = 1.0
    global_attn_every_n_layers: int = 4
    sliding_window: int = 1024
    layer_types: list | None = None
    mup_enabled: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 16384
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            n = self.global_attn_every_n_layers
            self.layer_types = [KINDS[bool((i + 1) % n)] for i in range(self.num_hidden_layers)]


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        base = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw, 10000.0), rope_scaling(raw), a.max_position_embeddings),
                             qk_norm=QKNorm.HEAD, norm_eps=a.rms_norm_eps, output=Output(out_norm=True))
        router = SimpleNamespace(n_routed_experts=a.num_experts, hidden_size=a.hidden_size, n_group=1, topk_group=1,
                                 num_experts_per_tok=a.num_experts_per_tok, routed_scaling_factor=a.route_scale,
                                 norm_topk_prob=True)  # (DeepSeek-V3's router, one group)

        def block(i: int) -> DecoderBlock:
            sliding = a.layer_types[i] == "sliding_attention"
            attn = GatedAttention(dataclasses.replace(
                base, positions=dataclasses.replace(base.positions, use_rope=sliding),
                scores=dataclasses.replace(base.scores, sliding_window=a.sliding_window if sliding else None)))
            if i < a.num_dense_layers:
                mlp = MLP(a.hidden_size, a.intermediate_size, out_norm_eps=a.rms_norm_eps)
            else:
                mlp = SparseMoE(deepseek_v3.Router(router),
                                SwitchGLU(i, a.hidden_size, a.moe_intermediate_size, a.num_experts),
                                MLP(a.hidden_size, a.moe_intermediate_size * a.num_shared_experts),
                                shared_name="shared_experts", out_norm=RMSNorm(a.hidden_size, a.rms_norm_eps))
            return DecoderBlock(attn, mlp, a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse AFMoE configs this file does not implement."""
    check_act_and_rope(NAME, cfg)
    n, kinds = cfg.get("num_hidden_layers"), cfg.get("layer_types")
    if kinds is not None and (len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    every = cfg.get("global_attn_every_n_layers", 4)
    if kinds is None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        refuse(NAME, "global_attn_every_n_layers", every, "an integer >= 1")
    if cfg.get("num_shared_experts", 2) in (0, None):
        refuse(NAME, "num_shared_experts", cfg.get("num_shared_experts"), "at least 1, as released")
    scale = cfg.get("route_scale", 1.0)
    if not is_number(scale) or scale <= 0:
        refuse(NAME, "route_scale", scale, "a number > 0")


_RENAMES = ((".post_attention_layernorm.", ".self_attn.out_norm."),
            (".pre_mlp_layernorm.", ".post_attention_layernorm."), (".post_mlp_layernorm.", ".mlp.out_norm."),
            (".mlp.router.gate.", ".mlp.gate."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name (each at most one rename: the released norms swap places with ours)."""
    return rename_first(name, _RENAMES)


class _Source(SplitRows):
    """Each layer's q_proj [H·D, in] and gate_proj [H·D, in] read as one q_proj [2·H·D, in]: per head, its D query
    rows then its D gate rows (Qwen3-Next's layout); gate_proj itself hidden."""

    def __init__(self, st, head_dim: int):
        super().__init__(st, {})
        self.head_dim = head_dim
        self.gates = {n for n in st.names() if n.endswith(".self_attn.gate_proj.weight")}

    def names(self) -> list[str]:
        return [n for n in self.st.names() if n not in self.gates]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.st.shape(name)
        return (2 * shape[0], *shape[1:]) if self._gate_of(name) else shape

    def nbytes(self, name: str) -> int:
        return self.st.nbytes(name) * (2 if self._gate_of(name) else 1)

    def read(self, name: str, index: int | None = None, of: int | None = None) -> torch.Tensor:
        gate = self._gate_of(name)
        if gate is None or index is not None:
            return super().read(name, index, of)
        q, g = self.st.read(name), self.st.read(gate)
        if q.shape != g.shape or q.dim() != 2 or q.shape[0] % self.head_dim:
            raise ColibriError(f"{gate} {list(g.shape)} does not match {name} {list(q.shape)} in heads of "
                               f"{self.head_dim}")
        d = self.head_dim
        return torch.cat([q.view(-1, d, q.shape[1]), g.view(-1, d, g.shape[1])], 1).reshape(-1, q.shape[1])

    def _gate_of(self, name: str) -> str | None:
        gate = name.replace(".self_attn.q_proj.weight", ".self_attn.gate_proj.weight")
        return gate if gate != name and gate in self.gates else None


def source_view(st, cfg: dict):
    """The checkpoint with gate_proj's rows inside q_proj (see `_Source`)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return _Source(st, head_dim)


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """muP: the embedding stored times sqrt(hidden_size) (a tied head is its own tensor, unscaled)."""
    if name == "model.embed_tokens.weight" and cfg.get("mup_enabled"):
        return (t.float() * math.sqrt(cfg["hidden_size"])).to(t.dtype)
    return t


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize,
                prepare=prepare)
