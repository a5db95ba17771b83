"""Dense SwiGLU MLPs (dense layers, shared experts, Qwen2-MoE's gated shared expert) through one native
call (kernels/moe.c coli_mlp_rows) where their three projections are native int8/int4 QLinears of one
scheme: gate and up in one pass over the rows, the activation in f32 rounded once, down, and the gate.

Both the per-layer path (layers.py MLP, moe.py SparseMoE) and the one-call step (native_step.py) take
this same kernel, so their bits agree; torch's ops remain the path for f32 (the oracle), GPUs, other
schemes and large prompt chunks. Measured on tiny models, the five torch ops per MLP cost ~40 us each
in Python per layer and token; one call is what lets the one-call step take these layers at all.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..kernels import native
from ..quant import QLinear

# per MLP module: (id of its gate, its constants), beside the module rather than in it (any module with the three
# projections may be one), gone with the module
_TABLES: weakref.WeakKeyDictionary[nn.Module, tuple[int, native.Mlp | None]] = weakref.WeakKeyDictionary()


def table(mlp: nn.Module, gate: nn.Module | None = None) -> native.Mlp | None:
    """The kernel's constants for `mlp` (gate_proj / up_proj / down_proj) behind `gate` ([1, H] sigmoid gate,
    or None), built once per gate; None where the kernel does not run them (a projection not native, with a
    bias, not bf16 compute, on another device, or of another scheme / group size)."""
    cached = _TABLES.get(mlp)
    if cached is not None and cached[0] == id(gate):
        return cached[1]
    t = _build(mlp, gate) if native.available() else None
    _TABLES[mlp] = (id(gate), t)
    return t


def _build(mlp: nn.Module, gate: nn.Module | None) -> native.Mlp | None:
    act = getattr(mlp, "native_act", native.ACT_SILU)
    ungated = act == native.ACT_RELU2  # (up_proj and down_proj alone: Nemotron-H's relu^2 MLP)
    names = ("up_proj", "down_proj") if ungated else ("gate_proj", "up_proj", "down_proj")
    projs = [getattr(mlp, n, None) for n in names] + ([gate] if gate else [])
    first = projs[0]
    if not all(isinstance(p, QLinear) and p.native_plain and p.compute_dtype == torch.bfloat16
               and p.qweight.device.type == "cpu" and p.scheme == first.scheme and p.group_size == first.group_size
               for p in projs):
        return None
    if gate is not None and gate.out_features != 1:
        return None
    qws = ([native.QW()] if ungated else []) + [native.QW(*native.qw(p)) for p in projs] \
        + ([] if gate else [native.QW()])
    alpha, limit = getattr(mlp, "clamp", (0.0, 0.0))  # (ACT_CLAMPED's gain and bound)
    return native.Mlp(first.out_features, 8 if first.scheme == "int8" else 4, first.group_size, int(gate is not None),
                      *qws, act, alpha, limit)


def forget(mlp: nn.Module) -> None:
    """Drop the constants (the weights moved)."""
    _TABLES.pop(mlp, None)


def applies(t: native.Mlp | None, x: torch.Tensor) -> bool:
    """Whether the kernel takes rows x: bf16 on the CPU, at most the kernels' row limit, and not a prefill
    chunk while torch owns the threads (then its GEMMs win, as for QLinear)."""
    return t is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 \
        and 0 < x.shape[0] <= native.MOE_MAX_ROWS \
        and not (x.shape[0] > 1 and native.get_threads() == 1 and torch.get_num_threads() > 1)


def run(mlp: nn.Module, x: torch.Tensor, gate: nn.Module | None = None) -> torch.Tensor | None:
    """sigmoid(gate(x)) * mlp(x) (without the factor when gate is None) in one native call, or None."""
    t = table(mlp, gate)
    return native.mlp(t, x.contiguous()) if applies(t, x) else None
