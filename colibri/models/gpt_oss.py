"""gpt-oss: attention sinks, alternating sliding-window / full layers, biases everywhere, a biased
top-k router softmaxed over the chosen experts, and a clamped SwiGLU with an (up + 1) term.

Checkpoints ship experts fused and transposed ([E, in, out]) with gate/up interleaved along the
output dim, often MXFP4-packed; `expert_record` turns one expert into the canonical record."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..errors import ColibriError
from ..kernels import native
from ..layers.attention import Attention, AttentionArgs, Output, Positions, Scores
from ..layers.layers import DecoderBlock, rope_scaling, rope_theta
from ..layers.moe import SoftmaxTopKRouter, SparseMoE, SwitchGLU  # (the router lives in moe.py: Granite shares it)
from .base import BaseArgs, CausalLM, check_act_and_rope
from .family import Family

_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class ModelArgs(BaseArgs):
    aliases = {"num_experts": "num_local_experts"}

    hidden_size: int
    intermediate_size: int  # the width of each expert
    num_hidden_layers: int
    num_attention_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.layer_types is None:  # the reference's default: even layers slide, odd ones see everything
            self.layer_types = [_LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]


def check_config(cfg: dict) -> None:
    """Refuse gpt-oss configs this file cannot run faithfully, naming the field."""
    q = cfg.get("quantization_config")
    if q and q.get("quant_method") != "mxfp4":
        method = q.get("quant_method")
        raise ColibriError(f"gpt_oss: quantization_config.quant_method={method!r} is not supported "
                           "(only mxfp4, which the converter dequantizes, or an unquantized checkpoint)")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != cfg.get("num_hidden_layers"):
            raise ColibriError(f"gpt_oss: layer_types has {len(types)} entries, num_hidden_layers is "
                               f"{cfg.get('num_hidden_layers')}")
        if bad := sorted(set(types) - set(_LAYER_TYPES)):
            raise ColibriError(f"gpt_oss: layer_types entry {bad[0]!r} is not supported "
                               f"({', '.join(_LAYER_TYPES)})")
    check_act_and_rope("gpt_oss", cfg, act=False)  # (its activation is its own clamped SwiGLU)


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """h: [.., 2I] (gate then up) -> [.., I]. The gate is clamped from above only, up on both sides."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        base = AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             Positions(rope_theta(raw, 150000.0), rope_scaling(raw), a.max_position_embeddings),
                             bias=a.attention_bias, norm_eps=a.rms_norm_eps, scores=Scores(sinks=True),
                             output=Output(o_bias=a.attention_bias))
        act = functools.partial(clamped_swiglu, alpha=a.swiglu_alpha, limit=a.swiglu_limit)

        def block(i: int) -> DecoderBlock:
            window = a.sliding_window if a.layer_types[i] == "sliding_attention" else None
            attn = Attention(dataclasses.replace(base, scores=dataclasses.replace(base.scores, sliding_window=window)))
            moe = SparseMoE(SoftmaxTopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok),
                            SwitchGLU(i, a.hidden_size, a.intermediate_size, a.num_local_experts, act,
                                      (native.ACT_CLAMPED, a.swiglu_alpha, a.swiglu_limit)))
            return DecoderBlock(attn, moe, a.hidden_size, a.rms_norm_eps)

        blocks = [block(i) for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the router sits where every other family's gate does."""
    return name.replace(".mlp.router.", ".mlp.gate.")


# ----------------------------------------------------------------------------- experts

# FP4 e2m1 code -> value; bit 3 is the sign (OCP Microscaling spec, as in transformers' mxfp4.py).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> f32. blocks: uint8 [R, G, 16] (32 FP4 codes per block, low nibble = even column),
    scales: uint8 [R, G] (e8m0: 2 ** (s - 127), one per block) -> [R, G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ColibriError(f"MXFP4 expects uint8 blocks/scales, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ColibriError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [R, G, 16, 2]: (even, odd) columns
    values = lut[codes].flatten(-2)  # [R, G, 32]
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)  # [R, G, 32]
    return out.flatten(-2)  # [R, G * 32]


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[2I, ...] rows g0, u0, g1, u1, ... -> [2I, ...] gate rows then up rows."""
    return torch.cat((t[0::2], t[1::2]), 0)


def _weight(parts: dict[str, torch.Tensor], part: str) -> torch.Tensor:
    """One expert's `part` weight as [out, in], from plain [in, out] or MXFP4 blocks ([out, in/32, 16])."""
    if part in parts:
        return parts[part].T  # the checkpoint stores x @ W, i.e. [in, out]
    if f"{part}_blocks" in parts:
        return mxfp4_dequantize(parts[f"{part}_blocks"], parts[f"{part}_scales"])
    raise ColibriError(f"gpt_oss expert lacks '{part}' (have {sorted(parts)})")


def expert_record(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical record of one expert: gate_up [2I, H] (gate rows then up rows) + bias [2I],
    down [H, I] + bias [H]."""
    return {
        "gate_up.weight": _deinterleave(_weight(parts, "gate_up")).contiguous(),
        "gate_up.bias": _deinterleave(parts["gate_up_bias"]).contiguous(),
        "down.weight": _weight(parts, "down").contiguous(),
        "down.bias": parts["down_bias"].contiguous(),
    }


FAMILY = Family("gpt_oss", ModelArgs, Model, check_config=check_config, sanitize=sanitize, expert_record=expert_record)
