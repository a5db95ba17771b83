"""ctypes side of coli_attn_layer (common.h; read by block.c's coli_attn_block and step.c): the core every standard
attention layer fills (`AttnLayer`, built by layers/attention.py's `Attention`), and its variants' small structs,
each built by the code that knows the variant (the family's attention class, or the shared piece that owns it) and
pointed to from the core; a NULL pointer is the variant absent. The call itself is native.py's `attn_block`."""

from __future__ import annotations

import ctypes

from .native import QW

_i, _f, _l, _p = ctypes.c_int, ctypes.c_float, ctypes.c_long, ctypes.c_void_p


class AttnValues(ctypes.Structure):
    """coli_attn_values: values unlike the keys' heads (MiMo-V2-Flash's width and scale; Gemma 4's keys as values,
    each value head RMS-normed by norm_w)."""

    _fields_ = [("dim", _i), ("scale", _f), ("k_eq_v", _i), ("norm_w", _p)]


class AttnGate(ctypes.Structure):
    """coli_attn_gate: the heads' output gate, `kind` an OutGate (colibri/layers/attention.py); `w` the softplus gates'
    projection (Laguna), `bias` bf16 [heads * head_dim] on a sigmoid gate (Beam)."""

    _fields_ = [("kind", _i), ("w", QW), ("bias", _p)]


class AttnPositions(ctypes.Structure):
    """coli_attn_positions: chunked attention (Llama 4) and the NoPE layers' temperature table, f32 [temp_n], read
    at floor((pos + 1) / temp_floor) (Llama 4, Beam)."""

    _fields_ = [("chunk", _i), ("temp", _p), ("temp_n", _l), ("temp_floor", _f)]


class AttnRotary(ctypes.Structure):
    """coli_attn_rotary: a layer's own rotary tables f32 [rows, rot] in the one-call step (MiMo-V2-Flash's second
    rotary embedding: colibri/engine/native_step.py)."""

    _fields_ = [("cos", _p), ("sin", _p), ("rows", _l)]


class AttnOutput(ctypes.Structure):
    """coli_attn_output: o_proj's output RMSNorm (AFMoE, FlexOlmo) and the parallel block's hand-over (Cohere: the
    MLP reads the input norm's output)."""

    _fields_ = [("norm_w", _p), ("norm_eps", _f), ("parallel", _i)]


class AttnKeep(ctypes.Structure):
    """coli_attn_keep: one call's kept key blocks, uint8 [T, kv_heads, nb] of blk positions (MiniMax-M3)."""

    _fields_ = [("blocks", _p), ("blk", _i), ("nb", _i)]


class AttnLayer(ctypes.Structure):
    """coli_attn_layer: one attention layer's core constants, then its variants (pointers, None where absent;
    ctypes keeps a pointed-to struct alive with the layer, and with an array the layer is copied into)."""

    _fields_ = [("hidden", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i), ("scheme", _i), ("group", _i),
                ("wq", QW), ("wk", QW), ("wv", QW), ("wo", QW),
                ("in_w", _p), ("post_w", _p), ("in_eps", _f), ("post_eps", _f),
                ("in_b", _p), ("post_b", _p),  # LayerNorm biases (f32 [hidden]), or NULL: RMSNorms
                ("qk_norm", _i), ("qn_w", _p), ("kn_w", _p), ("qk_eps", _f),  # qk_norm: a QKNorm
                ("clip", _f), ("rot", _i), ("window", _i), ("scale", _f), ("sinks", _p),
                ("bq", _p), ("bk", _p), ("bv", _p), ("bo", _p),
                ("mla", _p),  # a native_mla.MlaLayer's address: that block runs instead
                ("values", ctypes.POINTER(AttnValues)), ("gate", ctypes.POINTER(AttnGate)),
                ("positions", ctypes.POINTER(AttnPositions)), ("rotary", ctypes.POINTER(AttnRotary)),
                ("output", ctypes.POINTER(AttnOutput)), ("keep", ctypes.POINTER(AttnKeep))]


def ref(variant: ctypes.Structure | None):
    """A variant's pointer for AttnLayer's field (None: the variant absent)."""
    return None if variant is None else ctypes.pointer(variant)
