"""Liquid AI's LFM2-MoE (`lfm2_moe`: LFM2-8B-A1B): short gated convolutions and attention layers over routed experts.

- Each layer's mixer by `layer_types`: "full_attention" (GQA with per-head q/k RMSNorm, RoPE) or "conv": in_proj
  gives B, C and x; B * x runs through a causal depthwise convolution of `conv_L_cache` taps, times C, then
  out_proj. A conv layer's cache is its last `conv_L_cache - 1` inputs per sequence (linear attention's StateCache,
  without the delta rule's state).
- The first `num_dense_layers` feed-forwards are dense SwiGLU (`w1`, `w3`, `w2`), the rest routed experts: sigmoid
  scores, the top k chosen with `expert_bias` (selection only; none without `use_expert_bias`), renormalised with
  transformers' +1e-6 when `norm_topk_prob`, times `routed_scaling_factor`.
- Pre-norm blocks (`operator_norm`, `ffn_norm`), the final norm `embedding_norm`, the head tied by default
  (`tie_embedding`, the release's name).

Decode rows of the conv layers take kernels/conv.c (the whole block: norm, in_proj, gating, convolution, out_proj,
residual, post norm), prompts torch; the attention layers take the kernels' attention block and the MoE layers
their MoE block (the router in GLM's sigmoid rule: its 1e-20 where transformers adds 1e-6, on the
bf16 rows only), layer by layer: the one-call step needs one kind of mixer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native, native_conv
from ..layers.attention import Attention, AttentionArgs, Positions, QKNorm
from ..layers.batch import LayerKV
from ..layers.kvquant import DEFAULT, KVTypes
from ..layers.layers import MLP, DecoderBlock, Linear, rope_scaling, rope_theta
from ..layers.linear_attn import Conv1d, StateCache, block_weights, forget_block_weights, verify_rows
from ..layers.moe import SparseMoE, SwitchGLU
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse, rename_first
from .family import Family
from .glm4_moe import GroupLimitedRouter

NAME = "lfm2_moe"
KINDS = ("conv", "full_attention")


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int = 65536
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_key_value_heads: int = 8
    max_position_embeddings: int = 128_000
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    num_dense_layers: int = 2
    num_experts_per_tok: int = 4
    num_experts: int = 32
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    layer_types: list | None = None
    raw: dict | None = None


class ShortConv(nn.Module):
    """The gated short convolution of the module docstring: x [T, hidden] -> [T, hidden] over the step's sequences,
    each continuing its own `StateCache`."""

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.hidden, self.kernel = hidden, kernel
        self.in_proj = Linear(hidden, 3 * hidden, bias)
        self.conv = Conv1d(hidden, kernel)  # weight [H, 1, K]
        if bias:
            self.conv.bias = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.out_proj = Linear(hidden, hidden, bias)

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> StateCache:
        # (a recurrent state stays in the compute dtype whatever the K/V cache types)
        return StateCache(self.hidden, self.kernel, 0, 0, 0, dtype, device)  # (no delta-rule state: [0, 0, 0])

    def forward(self, x: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        if (y := verify_rows(self.forward, x, kv)) is not None:  # (a speculative verify: linear_attn.py)
            return y
        if self._native_rows(x, kv):  # bf16 decode rows: the gating and the convolution in one call
            y = native_conv.conv_rows(self.in_proj(x).contiguous(), self._states(kv), self.conv.weight,
                                      getattr(self.conv, "bias", None))
            return self.out_proj(y)
        b, c, u = self.in_proj(x).chunk(3, dim=-1)  # [T, H] x3
        bx, K = b * u, self.kernel
        w, bias = self.conv.weight, getattr(self.conv, "bias", None)
        outs = []
        for r0, r1, start, cache in kv.segs:
            cache.resume(start)
            n = r1 - r0
            seq = torch.cat([cache.conv, bx[r0:r1].T.to(cache.conv.dtype)], -1)  # [H, K-1+n]: the kept inputs first
            if start > 0:  # the taps summed in order from 0 in f32, as kernels/conv.c does (the same bits); torch's
                # depthwise conv1d also took ~100 us a decode row
                win = seq.unfold(1, K, 1)  # [H, n, K]
                y = torch.zeros(self.hidden, n, device=seq.device)  # (a GPU layer's state is on its GPU)
                for k in range(K):
                    y = y + win[..., k].float() * w[:, 0, k, None].float()
                if bias is not None:
                    y = y + bias[:, None].float()
            else:  # (from zeros: the padded form transformers computes)
                y = F.conv1d(bx[r0:r1].T[None].to(w.dtype), w, bias, padding=K - 1, groups=self.hidden)[0, :, :n]
            cache.conv.copy_(seq[:, -(K - 1):])
            cache.pos = start + n
            outs.append(y.T.to(x.dtype))
        y = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H]
        return self.out_proj(c * y)

    def fused(self, h: torch.Tensor, kv: LayerKV, in_norm, post_norm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + self(in_norm(h)), post_norm(that)) in one native call (kernels/conv.c coli_conv_block) for bf16 decode
        rows of native weights, with the bits of the layer-by-layer native path; else None."""
        first = self.in_proj
        if not self._native_rows(h, kv) \
                or (w := block_weights(self, (first, self.out_proj), in_norm, post_norm)) is None:
            return None
        return native_conv.conv_block(8 if first.scheme == "int8" else 4, first.group_size, w, h.contiguous(),
                                      in_norm, post_norm, self._states(kv), self.conv.weight,
                                      getattr(self.conv, "bias", None))

    def _native_rows(self, x: torch.Tensor, kv: LayerKV) -> bool:
        """Whether kernels/conv.c takes this step: bf16 rows on the CPU, one per sequence, each continuing its state,
        f32 taps; the f32 oracle path and prompts stay in torch."""
        bias = getattr(self.conv, "bias", None)
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] <= native.MOE_MAX_ROWS \
            and self.conv.weight.dtype == torch.float32 and self.conv.weight.is_contiguous() \
            and (bias is None or bias.dtype == torch.float32) and native.available() \
            and all(r1 - r0 == 1 and start > 0 and c.conv.dtype == torch.bfloat16 and c.conv.is_contiguous()
                    and c.conv.device.type == "cpu" for r0, r1, start, c in kv.segs)

    def _states(self, kv: LayerKV) -> list[int]:
        """Each row's state pointer, the states checked to continue and then counted one position on."""
        ptrs = []
        for _, _, start, cache in kv.segs:
            cache.resume(start)
            cache.pos = start + 1
            ptrs.append(cache.conv.data_ptr())
        return ptrs

    def _apply(self, fn, recurse: bool = True):  # moved weights: the fused call's pointers are stale
        forget_block_weights(self)
        return super()._apply(fn, recurse)


class Model(CausalLM):
    def __init__(self, a: ModelArgs):
        raw = a.raw or {}
        H = a.hidden_size
        attn = AttentionArgs(H, a.num_attention_heads, a.num_key_value_heads, H // a.num_attention_heads,
                             Positions(rope_theta(raw, 1e6), rope_scaling(raw), a.max_position_embeddings),
                             qk_norm=QKNorm.HEAD, norm_eps=a.norm_eps)

        def block(i: int) -> DecoderBlock:
            mixer = ShortConv(H, a.conv_L_cache, a.conv_bias) if a.layer_types[i] == "conv" \
                else Attention(attn)  # type: ignore[index]
            if i < a.num_dense_layers:
                return DecoderBlock(mixer, MLP(H, a.intermediate_size), H, a.norm_eps)
            gate = GroupLimitedRouter(H, a.num_experts, a.num_experts_per_tok, 1, 1, a.norm_topk_prob,
                                      a.routed_scaling_factor, bias=a.use_expert_bias, renorm_eps=1e-6)
            return DecoderBlock(mixer, SparseMoE(gate, SwitchGLU(i, H, a.moe_intermediate_size, a.num_experts)),
                                H, a.norm_eps)

        super().__init__(a.vocab_size, H, a.norm_eps, [block(i) for i in range(a.num_hidden_layers)])
        self.args = a


def check_config(cfg: dict) -> None:
    """Refuse LFM2-MoE configs this file does not implement."""
    check_act_and_rope(NAME, cfg)
    n = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in KINDS for k in kinds):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    if cfg.get("hidden_size", 0) % max(cfg.get("num_attention_heads") or 1, 1):
        refuse(NAME, "num_attention_heads", cfg["num_attention_heads"], "a divisor of hidden_size")
    k = cfg.get("conv_L_cache", 3)
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        refuse(NAME, "conv_L_cache", k, "an integer of at least 2 (a convolution over past inputs)")
    dense = cfg.get("num_dense_layers", 2)
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense < (n or 0):
        refuse(NAME, "num_dense_layers", dense, f"0 to {(n or 1) - 1}: at least one layer of experts")


_RENAMES = ((".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
            (".feed_forward.w2.", ".mlp.down_proj."), (".feed_forward.", ".mlp."),
            (".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."), (".conv.", ".self_attn."),
            ("model.embedding_norm.", "model.norm."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the feed-forward under `mlp` (the dense one's w1 / w3 / w2 as gate / up / down),
    a conv layer's mixer under `self_attn` as attention's, the norms under the decoder's names."""
    return rename_first(name, _RENAMES)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
