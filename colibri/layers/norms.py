"""The norms of the decoder blocks (RMSNorm, LayerNorm) and what the kernels' blocks take of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """Mean-centred norm with a bias (Phi-3.5-MoE's nn.LayerNorm; DBRX's has none: `bias=False`), in f32 with one
    rounding back; bf16 rows on the CPU in the kernels' (kernels/attn.c coli_layernorm), whose attention block
    computes it too."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        else:  # (a buffer of zeros: nothing to load; the kernels take a bias)
            self.register_buffer("bias", torch.zeros(dim), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and w.dtype == b.dtype == torch.float32 \
                and native.available():
            return native.layernorm(x, w, b, self.eps)
        return F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), self.eps).to(x.dtype)


class NoNorm(nn.Module):
    """No norm before a sublayer (FlexOlmo norms only the sublayers' outputs): the rows as they are; the native
    attention block takes it as a NULL weight."""

    eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def norm_weight_ptr(norm: nn.Module) -> int | None:
    """An input / post-attention norm's f32 weights for the native attention block (None: a NoNorm)."""
    return None if type(norm) is NoNorm else norm.weight.data_ptr()


def out_norm_ptr(m: nn.Module) -> tuple[int | None, float] | None:
    """A sublayer's own output RMSNorm (`m.out_norm`: AFMoE's) as the kernels take it: (f32 weights' pointer, eps),
    (None, 0.0) where it has none, None where the kernels cannot take it."""
    norm = getattr(m, "out_norm", None)
    if norm is None:
        return None, 0.0
    w = norm.weight
    if type(norm) is not RMSNorm or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    return w.data_ptr(), norm.eps


def is_rms(norm: nn.Module) -> bool:
    """The norm every native block computes (they read only `weight` and `eps`); the attention block also takes
    a LayerNorm (`block_norm_bias`)."""
    return type(norm) is RMSNorm


def block_norm_bias(norm: nn.Module) -> int | None | bool:
    """What the native attention block takes for an input / post-attention norm: None (an RMSNorm, or no norm), the
    pointer to a LayerNorm's f32 bias, or False (neither: the block does not apply)."""
    if type(norm) in (RMSNorm, NoNorm):
        return None
    if type(norm) is LayerNorm and norm.bias.dtype == torch.float32 and norm.bias.is_contiguous():
        return norm.bias.data_ptr()
    return False


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / rms(x) over the last dim, normalised in f32 like the reference, one rounding back to x's
    dtype; bf16 rows on the CPU in one native call instead of six small ops (w f32 [H])."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and w.dtype == torch.float32 and native.available():
        return native.rmsnorm(x, w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w * xf).to(x.dtype)
