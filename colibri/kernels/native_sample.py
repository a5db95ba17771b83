"""ctypes side of kernels/sample.c: one token from one logits row (colibri/engine/sampling.py's rule)."""

from __future__ import annotations

import ctypes

import torch

from . import native

_declared = False


def _lib() -> ctypes.CDLL:
    global _declared
    lib = native.lib()
    if not _declared:
        f = ctypes.c_float
        lib.coli_sample.argtypes = [ctypes.c_void_p, ctypes.c_long, f, ctypes.c_int, f, f, ctypes.c_double]
        lib.coli_sample.restype = ctypes.c_long
        p = ctypes.c_void_p
        lib.coli_logprobs.argtypes = [p, ctypes.c_long, ctypes.c_long, ctypes.c_int, p, p, p]
        lib.coli_logprobs.restype = ctypes.c_int
        _declared = True
    return lib


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """coli_sample: logits [V] f32 contiguous (CPU), u in [0, 1) -> the token (ValueError when the row has
    a NaN or no finite value)."""
    tok = _lib().coli_sample(logits.data_ptr(), logits.shape[0], temperature, top_k, top_p, min_p, u)
    if tok == -1:
        raise ValueError("cannot sample: the logits have a NaN or no finite value")
    if tok < 0:
        raise MemoryError("coli_sample: out of memory")
    return int(tok)


def logprobs(logits: torch.Tensor, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """coli_logprobs: logits [V] f32 contiguous (CPU), n_top <= 20 -> (log softmax(logits)[tok], the n_top most
    likely tokens' (id, log-probability), most likely first); ValueError for a NaN or no finite value."""
    lp = ctypes.c_float()
    ids = (ctypes.c_int64 * max(n_top, 1))()
    vals = (ctypes.c_float * max(n_top, 1))()
    if _lib().coli_logprobs(logits.data_ptr(), logits.shape[0], tok, n_top, ctypes.byref(lp), ids, vals):
        raise ValueError("log-probs: the logits have a NaN or no finite value")
    return lp.value, [(ids[i], vals[i]) for i in range(n_top)]
