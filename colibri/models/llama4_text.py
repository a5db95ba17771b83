"""Llama 4 (Scout, Maverick), text model: GQA attention with interleaved RoPE on three layers in four
(and a weightless L2 norm of q and k after it), no RoPE on the fourth (whose queries are scaled up with
the position instead: attention temperature tuning), chunked attention on the RoPE layers; MoE layers of
one routed expert a token (sigmoid of its router logit, applied to the expert's *input*) plus a shared
expert, or dense layers where `moe_layers` / `interleave_moe_layer_step` say so. The released
checkpoints are multimodal (`llama4`, the text model under `text_config`): convert keeps the text model.

At bf16 on the CPU the layers take the fused native blocks and the one-call step like the other families:
kernels/block.c has the L2 norm after the rotary, the temperature and the chunks; kernels/moe.c the scaled
input (its `coli_expert_act.input_scaled`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ColibriError
from ..kernels import native, native_block
from ..layers.attention import Attention, AttentionArgs, Output, Positions, QKNorm, attend
from ..layers.batch import LayerKV
from ..layers.layers import MLP, DecoderBlock, rms_norm, rope_scaling, rope_theta, rotate_half_rows
from ..layers.moe import RouteRule, SparseMoE, SwitchGLU, native_route
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_local_experts: int
    vocab_size: int
    num_experts_per_tok: int = 1
    intermediate_size_mlp: int = 16384
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    moe_layers: list[int] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: list[str] | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    attention_bias: bool = False
    raw: dict | None = None

    def __post_init__(self):  # transformers' Llama4TextConfig defaults
        n = self.num_hidden_layers
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if not self.no_rope_layers:  # 1: the layer uses RoPE (the name says the opposite)
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            self.moe_layers = list(range(step - 1, n, step))
        if self.layer_types is None:
            self.layer_types = ["chunked_attention" if r else "full_attention" for r in self.no_rope_layers]


def check_config(cfg: dict) -> None:
    check_act_and_rope("llama4", cfg)
    n = cfg.get("num_hidden_layers") or 0
    for key in ("no_rope_layers", "layer_types"):
        v = cfg.get(key)
        if v and len(v) != n:
            refuse("llama4", key, v, f"one entry per layer ({n})")
    kinds = cfg.get("layer_types") or []
    if any(k not in ("full_attention", "chunked_attention") for k in kinds):
        refuse("llama4", "layer_types", kinds, "full_attention / chunked_attention")
    if any(not isinstance(i, int) or not 0 <= i < n for i in cfg.get("moe_layers") or []):
        refuse("llama4", "moe_layers", cfg["moe_layers"], f"layer indices below {n}")
    if (cfg.get("num_experts_per_tok") or 1) != 1:
        refuse("llama4", "num_experts_per_tok", cfg["num_experts_per_tok"],
               "1: the router's score scales the expert's input, as in the released models")
    for key in ("interleave_moe_layer_step", "no_rope_layer_interval", "floor_scale", "attention_chunk_size"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, int) or v < 1):
            refuse("llama4", key, v, "a positive integer")


class Llama4Attention(Attention):
    """Attention with per-layer RoPE, an L2 q/k norm after it, temperature tuning on the layers without RoPE,
    and chunked attention: a query sees the keys of its own `chunk`-position block. Llama 4 rotates interleaved
    channel pairs; the converter stores q_proj / k_proj rows in rotate-half order instead (`prepare`), so the
    RoPE here is the native rotate-half one (q and k alike: attention and the per-head norm are unchanged)."""

    def __init__(self, a: AttentionArgs, use_rope: bool, qk_norm: bool, chunk: int | None,
                 temperature: tuple[float, float] | None):
        super().__init__(a)
        self.use_rope, self.l2, self.chunk = use_rope, qk_norm, chunk
        self.register_buffer("ones", torch.ones(a.head_dim), persistent=False)  # the L2 norm's weight
        self.temperature = temperature  # (floor_scale, attn_scale) on a layer without RoPE, else None
        if temperature is not None:
            # The scale of every m = floor((pos + 1) / floor_scale) up to max(max_pos, 2^20) positions: torch's
            # values, which the native block reads too (one table: the paths cannot differ in a last bit).
            floor_scale, attn_scale = temperature
            m = torch.arange(max(a.positions.max_pos, 1 << 20) // int(floor_scale) + 2, dtype=torch.float32)
            self.register_buffer("temp", torch.log(m + 1.0) * attn_scale + 1.0, persistent=False)  # [M]

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        a, T = self.a, x.shape[0]
        q = self.q_proj(x).view(T, a.heads, a.head_dim)
        k = self.k_proj(x).view(T, a.kv_heads, a.head_dim)
        v = self.v_proj(x).view(T, a.kv_heads, a.head_dim)
        if self.use_rope:
            q, k = self.rope(q, kv.pos), self.rope(k, kv.pos)
        if self.l2:
            q, k = rms_norm(q, self.ones, a.norm_eps), rms_norm(k, self.ones, a.norm_eps)  # weightless L2Norm
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            m = torch.floor((self._positions(kv, T, x.device) + 1.0) / floor_scale)  # [T] f32
            # the table on the CPU (the native blocks' values); elsewhere, or past it, the formula (no host sync)
            if x.device.type == "cpu" and int(m.max()) < self.temp.shape[0]:
                scale = self.temp[m.long()]
            else:
                scale = torch.log(m + 1.0) * attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D], [Hkv, T, D] x2
        outs = []
        for r0, r1, start, cache in kv.segs:
            k_all, v_all = cache.update(k[:, r0:r1], v[:, r0:r1], start)
            outs.append(self._attend(q[:, r0:r1], k_all, v_all, start))
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Attention.fused (kernels/block.c) where the rows' positions are in the temperature table."""
        if self.temperature is not None and self.pos_limit() <= kv.end:
            return None
        return super().fused(h, kv, in_norm, post_norm)

    def pos_limit(self) -> int:
        """Positions below this have a temperature table entry (the native block's limit)."""
        return (self.temp.shape[0] - 1) * int(self.temperature[0]) - 1 if self.temperature is not None else 1 << 62

    def _build_native_layer(self, in_norm, post_norm):
        layer = super()._build_native_layer(in_norm, post_norm)
        if layer is None:
            return None
        if self.l2:  # mode 3: per head after the rotary, weights of ones
            layer.qk_norm, layer.qn_w, layer.kn_w = QKNorm.HEAD_POST_ROPE, self.ones.data_ptr(), self.ones.data_ptr()
            layer.qk_eps = self.a.norm_eps
        layer.rot = self.rope.dim if self.use_rope else 0
        if self.chunk or self.temperature is not None:  # chunked attention, or the NoPE layers' temperature
            temp = (None, 0, 0.0) if self.temperature is None \
                else (self.temp.data_ptr(), self.temp.shape[0], self.temperature[0])
            layer.positions = native_block.ref(native_block.AttnPositions(self.chunk or 0, *temp))
        return layer

    @staticmethod
    def _positions(kv: LayerKV, T: int, device: torch.device) -> torch.Tensor:
        if isinstance(kv.pos, int):
            return torch.arange(kv.pos, kv.pos + T, device=device, dtype=torch.float32)
        return kv.pos.to(device=device, dtype=torch.float32)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """One sequence's rows q [H, n, D] at positions start.. over its keys k/v [Hkv, S, D] -> [n, H * D];
        chunked: each run of rows in one block of `chunk` positions over that block's keys alone."""
        n, C = q.shape[1], self.chunk
        if C is None or (start + n - 1) // C == 0:
            return attend(q, k, v, start, self.scale)
        pieces, p = [], start
        while p < start + n:
            c0 = p // C * C
            end = min(c0 + C, start + n)
            rows = q[:, p - start : end - start]
            pieces.append(attend(rows, k[:, c0:], v[:, c0:], p - c0, self.scale))
            p = end
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class Llama4Router(nn.Module):
    """Top-k router logits; the chosen experts' scores are the sigmoids of their logits (in f32: transformers'
    bf16 Linear rounds the logits first)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)  # [E, H], f32
        self.top_k = top_k
        self.register_buffer("zeros", torch.zeros(num_experts), persistent=False)  # (the kernel's selection bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = native_route(self, x)  # bf16 rows: one native call (kernels/route.c), the sigmoid rule
        if routed is not None:
            return routed[0], routed[1].to(x.dtype)
        logits = x.float() @ self.weight.T  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        return idx, torch.sigmoid(top).to(x.dtype)

    def native_routing(self) -> RouteRule:
        """The kernels' sigmoid rule with no selection bias, not renormalised: top-k by logit, its sigmoid."""
        return RouteRule(native.ROUTE_SIGMOID, False, self.zeros, 1.0)


class Llama4MoE(SparseMoE):
    """shared(x) + expert(score * x): the router's score scales the routed expert's input, not its output."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.experts.input_scaled = True  # (the scores still reach the routing log and trace)

    def fused(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """SparseMoE.fused: the kernel scales the input (the experts' tables say input_scaled)."""
        return super().fused(x, h)

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        idx, score = self.gate(x)  # [T, 1] x2
        return self.shared_expert(x) + self.experts(x * score, idx, score, resid)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        base = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw, 500000.0), rope_scaling(raw), a.max_position_embeddings),
                             bias=a.attention_bias, norm_eps=a.rms_norm_eps, output=Output(o_bias=a.attention_bias))

        def block(i: int) -> DecoderBlock:
            rope = bool(a.no_rope_layers[i])
            chunk = a.attention_chunk_size if a.layer_types[i] == "chunked_attention" else None
            temperature = (float(a.floor_scale), a.attn_scale) if a.attn_temperature_tuning and not rope else None
            attn = Llama4Attention(base, rope, a.use_qk_norm and rope, chunk, temperature)
            if i in a.moe_layers:
                mlp = Llama4MoE(Llama4Router(a.hidden_size, a.num_local_experts, a.num_experts_per_tok),
                                SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_local_experts),
                                MLP(a.hidden_size, a.intermediate_size))
            else:
                mlp = MLP(a.hidden_size, a.intermediate_size_mlp)
            return DecoderBlock(attn, mlp, a.hidden_size, a.rms_norm_eps)

        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the text model of a multimodal checkpoint (its vision tower dropped), the
    feed-forward block as `mlp`, the router where every other family's gate is."""
    if name.startswith(("vision_model.", "multi_modal_projector.")):
        return None
    name = name.removeprefix("language_model.")
    return name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """q_proj / k_proj rows reordered per head from interleaved RoPE pairs to rotate-half ones (Llama4Attention;
    as ERNIE-4.5's converter does)."""
    if not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias",
                          "self_attn.k_proj.bias")):
        return t
    return rotate_half_rows(t, ModelArgs.from_dict(cfg).head_dim)


def expert_record(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's canonical record from the fused [E, in, out] tensors (x @ W): gate_up [2I, H] (gate rows,
    then up rows: transformers chunks the product's last dim in that order), down [H, I]."""
    if "gate_up" not in parts or "down" not in parts:
        raise ColibriError(f"llama4 expert lacks gate_up/down (have {sorted(parts)})")
    return {"gate_up.weight": parts["gate_up"].T.contiguous(), "down.weight": parts["down"].T.contiguous()}


FAMILY = Family("llama4_text", ModelArgs, Model, check_config=check_config, sanitize=sanitize, prepare=prepare,
                expert_record=expert_record)
