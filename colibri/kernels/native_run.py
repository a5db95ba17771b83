"""ctypes side of coli_decode_run (kernels/step.c) and its rows' logit processors (kernels/procs.c): several
decode steps of a batch in one call, each row's pick made in C (engine/runner.py's native runs)."""

from __future__ import annotations

import ctypes

import torch

from . import native

_declared = False
LP_MAX = 20  # kernels/common.h COLI_LP_MAX: alternatives a row's log-probs may list (OpenAI's limit)


def _lib() -> ctypes.CDLL:
    global _declared
    lib = native.lib()
    if not _declared:
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.coli_decode_run.argtypes = [p, p, i, i, p, p, p, p, p, ctypes.c_long, ctypes.c_long, i, p, p,
                                        ctypes.c_long, i, p, i, p, p, p, p, p, p, p, p, p, p, p]
        lib.coli_decode_run.restype = i
        _declared = True
    return lib


class Procs(ctypes.Structure):
    """coli_procs (procs.c): a row's logit processors in coli_decode_run; `procs` builds one."""

    _fields_ = [("bias_ids", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n_bias", ctypes.c_int),
                ("repeat_penalty", ctypes.c_float), ("window", ctypes.c_int), ("hist", ctypes.c_void_p),
                ("n_hist", ctypes.c_int), ("presence", ctypes.c_float), ("frequency", ctypes.c_float),
                ("gen_ids", ctypes.c_void_p), ("gen_counts", ctypes.c_void_p), ("n_gen", ctypes.c_int)]


def procs(spec, n_steps: int) -> tuple[Procs, tuple]:
    """A Procs for a run of n_steps from `spec` (engine/sampling.py RunProcs), and the arrays it points into
    (keep them alive through the call): the history and counts get room for the run's tokens."""
    hist = (ctypes.c_int64 * (len(spec.history) + n_steps))(*spec.history)
    ids = (ctypes.c_int64 * (len(spec.counts) + n_steps))(*spec.counts)
    counts = (ctypes.c_int * (len(spec.counts) + n_steps))(*spec.counts.values())
    bias_ids = (ctypes.c_int64 * len(spec.bias))(*spec.bias)
    bias = (ctypes.c_float * len(spec.bias))(*spec.bias.values())
    p = Procs(ctypes.addressof(bias_ids), ctypes.addressof(bias), len(spec.bias), spec.repeat_penalty, spec.window,
              ctypes.addressof(hist), len(spec.history), spec.presence, spec.frequency, ctypes.addressof(ids),
              ctypes.addressof(counts), len(spec.counts))
    return p, (hist, ids, counts, bias_ids, bias)



def decode_run(tail, tokens: list[int], attn, moe, pos0: list[int], kc, vc, ks: int, vs: int,
               rope: tuple[int, int, int], k: int, n_steps: int, stop: torch.Tensor,
               sampling: list[tuple[float, int, float, float]] | None = None, uniforms: list[list[float]] | None = None,
               processors: list | None = None, logprobs: list[int | None] | None = None, kvt: int = 0
               ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, list | None]:
    """coli_decode_run: up to n_steps decode steps of T sequences (one row each) from `tokens` at positions
    `pos0`, ending after a step in which a row picked a token of `stop` (int64 [S], contiguous) -> (per step
    the T tokens picked, idx, weights [n, L, T, k]). A row picks the argmax, or with `sampling[t]` =
    (temperature > 0, top_k, top_p, min_p) samples with `uniforms[t][step]` (kernels/sample.c); with
    `processors[t]` (an engine/sampling.py RunProcs, or None) of its logits after those (kernels/procs.c).
    With `logprobs[t]` = n (not None), per step the pick's log-probability and the n most likely tokens'
    (kernels/logprobs.c) -> the fourth item, [step][row] (logprob, [(id, logprob)]) or None. kvt: the caches' row
    types (native_attn.attn_block's)."""
    T, L = len(tokens), len(attn)
    idx, wts = native._routes(n_steps * L, T, k)
    out = torch.empty(n_steps, T, dtype=torch.int64)
    samp = u = None
    if sampling is not None:
        samp = (ctypes.c_float * (4 * T))(*(float(v) for row in sampling for v in row))
        u = (ctypes.c_double * (n_steps * T))(*(uniforms[t][s] if sampling[t][0] > 0 else 0.0
                                                for s in range(n_steps) for t in range(T)))
    pr = keep = None
    if processors is not None:
        built = [procs(sp, n_steps) if sp is not None else (Procs(), ()) for sp in processors]
        pr, keep = (Procs * T)(*(b[0] for b in built)), [b[1] for b in built]
    lp_n = lp = lp_ids = lp_vals = None
    if logprobs is not None:
        lp_n = (ctypes.c_int * T)(*(-1 if n is None else n for n in logprobs))
        lp = torch.empty(n_steps, T, dtype=torch.float32)
        lp_ids = torch.empty(n_steps, T, LP_MAX, dtype=torch.int64)
        lp_vals = torch.empty(n_steps, T, LP_MAX, dtype=torch.float32)
    failed = ctypes.c_int(-1)
    n = _lib().coli_decode_run(ctypes.byref(tail), (ctypes.c_int64 * T)(*tokens), T, L, attn, moe,
                               (ctypes.c_int * T)(*pos0), kc, vc, ks, vs, kvt, *rope, n_steps, stop.data_ptr(),
                               stop.shape[0], samp, u, pr, lp_n, *(None if t is None else t.data_ptr()
                                                                   for t in (lp, lp_ids, lp_vals)),
                               out.data_ptr(), idx.data_ptr(), wts.data_ptr(), ctypes.byref(failed))
    del keep
    if n == -6:
        raise IndexError(f"token id out of range (vocabulary of {tail.vocab_in})")
    if n == -7:
        raise ValueError("cannot sample: the logits have a NaN or no finite value")
    if n == -8:
        raise IndexError(f"a logit processor's token id is out of range (vocabulary of {tail.vocab})")
    if n < 1:
        raise native._step_failed("coli_decode_run", n, failed)
    lps = None
    if logprobs is not None:
        lv, ids, vals = lp[:n].tolist(), lp_ids[:n].tolist(), lp_vals[:n].tolist()
        lps = [[None if m is None else (lv[s][t], list(zip(ids[s][t][:m], vals[s][t][:m])))
                for t, m in enumerate(logprobs)] for s in range(n)]
    return out[:n].tolist(), idx[: n * L].view(n, L, T, k), wts[: n * L].view(n, L, T, k), lps
