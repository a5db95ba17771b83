"""Calibrated low-bit quantization: activation statistics (imatrix-style) and an importance-weighted quantizer.

1. Statistics (`gather`): the bf16 model runs over a calibration text on colibri's own engine, with
   hooks that add, per linear weight, the sum over every input row x it sees of x x^T (`full`, when
   all of them fit FULL_MAX_BYTES: the demo model needs 22 MiB) or only its diagonal x^2 (llama.cpp's
   imatrix). Routed experts see only the tokens routed to them: the hook sits on the expert source,
   so expert e's `gate_up`/`down` count only their own rows. When the full matrices do not all fit
   (any large model), x x^T is kept within the budget for, in this order, each MoE layer's pooled
   expert `gate_up` input (`<layer>.experts.pooled.gate_up.weight`: every routed row of the layer, one
   [hidden, hidden] matrix shared by all its experts) and the dense linears, smallest first; the
   rest (every expert's own statistics among them) keep the diagonal.
2. Experts that see few tokens (`ActivationStats.second_moment`): an expert that saw n rows is blended
   with a prior worth PRIOR_TOKENS rows: (sum_e x x^T + PRIOR_TOKENS * prior) / (n + PRIOR_TOKENS).
   For `gate_up` the prior is the layer's pooled E[x x^T] over all routed tokens (every expert of a
   layer reads the same hidden state); for `down` it is a multiple of the identity at the layer's mean
   E[x^2] (intermediate channels mean different things in different experts). An expert no
   calibration token reached thus gets the layer's statistics (gate_up) or none in effect (down: a
   flat prior is plain rounding); one with thousands of tokens essentially its own. Under the budget
   (item 1) an expert's `gate_up` gets the layer's pooled x x^T for GPTQ instead (docs/QUANT.md has
   what that costs). A weight no hook saw gets uniform weights and is counted in `unseen` (the
   converter reports it).
3. Quantization (`quantize_calibrated`), into the canonical layout of `colibri.quant` (docs/FORMAT.md):
   calibration changes values, not the layout.
   - full statistics: GPTQ (`quantize_gptq`): columns rounded left to right, each one's rounding
     error spread over the columns not yet rounded through the inverse of E[x x^T] (1% damping), so
     the layer's output error on the calibration activations is minimised rather than the weight error;
   - diagonal only: `quantize_weighted`: for each group the (scale, min) pair is chosen by a small
     search, llama.cpp's make_qkx3 style: candidate scales around (max - min) / qmax, each followed by
     the importance-weighted least-squares (scale, min) for its rounding, rounded to the stored f16,
     the weights re-rounded against them, and the lowest importance-weighted squared error kept (the
     plain min/max choice is one of the candidates, so it is never worse on that measure). GPTQ
     chooses each group's (scale, min) the same way, on the error-updated weights.
   docs/QUANT.md has the measured effect of each.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from torch import Tensor

from ..errors import ColibriError
from ..quant import _BITS, _check_scheme, _pack, _shape_error, can_quantize

POOLED = "pooled"  # in place of an expert index: a layer's statistics over all its routed rows
PRIOR_TOKENS = 64  # an expert's own statistics outweigh the layer's once it has seen more tokens than this
_FLOOR = 1e-3  # importance floor, relative to the tensor's mean: no channel is ignored entirely
_SEARCH_CHUNK_ELEMS = 1 << 21  # weights searched at a time (the search holds ~10 f32 temporaries)
# Candidate inverse scales (qmax + RMIN + RDELTA * i) / (max - min), i = 0..NSTEP (llama.cpp make_qkx3).
RMIN, RDELTA, NSTEP = -0.9, 0.05, 36
# Full E[x x^T] statistics (GPTQ) are collected when all of them fit in this; else only the diagonal.
FULL_MAX_BYTES = 4 << 30
DAMP = 0.01  # GPTQ's dampening: this fraction of the mean diagonal is added to E[x x^T]


class ActivationStats:
    """Per weight name: the sum over input rows of x^T x (f64 [in, in], `full`) or of x^2 per input
    channel (f64 [in], its diagonal), and the number of input rows."""

    def __init__(self, full: bool = False) -> None:
        self.full = full
        self.full_names: set[str] = set()  # with full=False: the weights that keep x x^T all the same
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.source = ""  # what the statistics were gathered on, for the container's metadata
        self.unseen: list[str] = []  # weights quantize_calibrated found no statistics for (uniform weights)

    def add(self, name: str, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # [rows, in]
        full = self.full or name in self.full_names
        part = (x.T @ x if full else x.pow(2).sum(0)).double().cpu()  # [in, in] or [in]
        if name in self.sums:
            self.sums[name] += part
        else:
            self.sums[name] = part
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]

    def _diag(self, t: Tensor) -> Tensor:
        return t.diagonal() if t.dim() == 2 else t

    def mean(self, name: str) -> Tensor | None:
        n = self.counts.get(name, 0)
        return self._diag(self.sums[name]) / n if n else None

    def _layer_pool(self, prefix: str, part: str) -> tuple[Tensor | None, int]:
        """Summed x^2 and rows over every expert of the layer `prefix` for member `part`."""
        keys = [k for k in self.sums if _expert_name(k) == (prefix, part)]  # not the `pooled` entry
        if not keys:
            return None, 0
        return sum(self.sums[k] for k in keys), sum(self.counts[k] for k in keys)

    def second_moment(self, name: str) -> Tensor | None:
        """E[x x^T] [in, in] (full statistics) or E[x^2] [in] of weight `name`'s input, experts blended
        with their layer's prior (module docstring); None when no hook saw the weight."""
        expert = _expert_name(name)
        if expert is None:
            n = self.counts.get(name, 0)
            return self.sums[name] / n if n else None
        prefix, part = expert
        shared = f"{prefix}.{POOLED}.{part}"
        if self.counts.get(shared) and self.sums[shared].dim() == 2:
            own = self.sums.get(name)
            if own is None or own.dim() == 1:  # the budget kept x x^T for the layer only
                return self.sums[shared] / self.counts[shared]
        pooled, n_layer = self._layer_pool(prefix, part)
        if pooled is None or n_layer == 0:
            return None
        prior = pooled / n_layer  # [in, in] or [in]
        if part.startswith("down"):  # flat at the layer's mean level: no shared channel meaning
            level = self._diag(prior).mean().item()
            prior = torch.eye(len(prior), dtype=prior.dtype) * level if prior.dim() == 2 else torch.full_like(
                prior, level)
        own, n = self.sums.get(name), self.counts.get(name, 0)
        total = PRIOR_TOKENS * prior + (own if own is not None else 0.0)
        return total / (n + PRIOR_TOKENS)

    def importance(self, name: str) -> Tensor | None:
        """Per-input-channel importance E[x_j^2] [in] f32 of weight `name`, or None (uniform)."""
        m = self.second_moment(name)
        return None if m is None else self._diag(m).float()

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in self.sums.items()}
        meta = {"counts": ",".join(f"{k}={v}" for k, v in self.counts.items()), "source": self.source,
                "full": str(int(self.full))}
        meta["full_names"] = ",".join(sorted(self.full_names))
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ActivationStats:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                s = cls(full=meta.get("full") == "1")
                s.sums = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except Exception as e:  # safetensors' own error types: a truncated or foreign file
            raise ColibriError(f"{path}: not a readable statistics file ({e})") from None
        s.counts = {k: int(v) for k, v in (kv.rsplit("=", 1) for kv in meta.get("counts", "").split(",") if kv)}
        s.source = meta.get("source", str(path))
        s.full_names = {n for n in meta.get("full_names", "").split(",") if n}
        if set(s.counts) != set(s.sums):
            raise ColibriError(f"{path}: not a colibri activation-statistics file (counts do not match tensors)")
        return s


def _expert_name(name: str) -> tuple[str, str] | None:
    """`model.layers.3.mlp.experts.5.down.weight` -> ("model.layers.3.mlp.experts", "down.weight")."""
    head, sep, rest = name.partition(".experts.")
    if not sep:
        return None
    e, _, part = rest.partition(".")
    return (head + ".experts", part) if e.isdigit() and part else None


# ----------------------------------------------------------------------------- gathering


class _Recorded:
    """Calls a linear and adds its input to the statistics under each of `names`."""

    def __init__(self, inner, stats: ActivationStats, names: tuple[str, ...]):
        self.inner, self.stats, self.names = inner, stats, names

    def __call__(self, x: Tensor) -> Tensor:
        for name in self.names:
            self.stats.add(name, x)
        return self.inner(x)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class _RecordingSource:
    """Wraps a layer's expert source: every expert it hands out records its inputs (routed rows only)."""

    def __init__(self, inner, stats: ActivationStats, prefix: str):
        self.inner, self.stats, self.prefix = inner, stats, prefix

    def fetch(self, layer: int, ids: list[int]):
        return self._recorded(self.inner.fetch(layer, ids))  # the inner fetch begins now, as the layer expects

    def _recorded(self, fetched):
        shared = f"{self.prefix}.{POOLED}.gate_up.weight"
        pooled = (shared,) if shared in self.stats.full_names else ()  # the layer's x x^T (budget, item 1)
        for e, w in fetched:
            rec = {f.name: _Recorded(getattr(w, f.name), self.stats,
                                     (f"{self.prefix}.{e}.{f.name}.weight", *(pooled if f.name == "gate_up" else ())))
                   for f in dataclasses.fields(w) if f.name in ("gate_up", "down")}
            yield e, dataclasses.replace(w, **rec)

    def __getattr__(self, attr):  # prefetch and anything else the layer asks of its source
        return getattr(self.inner, attr)


def budget_full_names(model: torch.nn.Module, budget: int) -> set[str]:
    """The weights whose x x^T (f64) fit in `budget` bytes, in priority order: each MoE layer's
    pooled expert `gate_up` (one matrix serves all the layer's experts), then dense linears, smallest first."""
    from ..layers.moe import SwitchGLU
    from ..quant import QLinear

    pooled = [(f"{n}.{POOLED}.gate_up.weight", m.hidden ** 2) for n, m in model.named_modules()
              if isinstance(m, SwitchGLU) and m.source is not None]
    dense = sorted(((f"{n}.weight", m.in_features ** 2) for n, m in model.named_modules() if isinstance(m, QLinear)),
                   key=lambda t: t[1])
    chosen, used = set(), 0
    for name, elems in pooled + dense:
        if used + 8 * elems <= budget:
            chosen.add(name)
            used += 8 * elems
    return chosen


def full_stats_bytes(model: torch.nn.Module) -> int:
    """Bytes the full E[x x^T] statistics of every linear and routed expert of `model` would take (f64)."""
    from ..layers.moe import SwitchGLU
    from ..quant import QLinear

    n = 0
    for mod in model.modules():
        if isinstance(mod, QLinear):
            n += mod.in_features ** 2
        elif isinstance(mod, SwitchGLU):
            n += mod.num_experts * (mod.hidden ** 2 + mod.intermediate ** 2)
    return 8 * n


def gather(model: str | os.PathLike, text: str, ctx_size: int = 512, threads: int | None = None,
           slots: int = 4, progress: bool | None = None, full: bool | None = None,
           max_full_bytes: int | None = None) -> ActivationStats:
    """Run the container `model` (bf16 or f32) over `text` and collect activation statistics.

    The text is cut into windows of `ctx_size` tokens (the last one may be shorter); every token
    counts. Dense linears are hooked with forward pre-hooks, routed experts through their source.
    `full`: True: E[x x^T] (for GPTQ) for every weight; False: the diagonal only; None: all of E[x x^T]
    when it fits `max_full_bytes` (default FULL_MAX_BYTES), else what that budget allows (module docstring,
    item 1)."""
    from tqdm import tqdm

    from ..api import Engine
    from ..layers.moe import SwitchGLU
    from ..quant import QLinear

    with Engine(model, ctx_size=ctx_size, threads=threads, slots=slots) as eng:
        need, chosen = full_stats_bytes(eng.model), set()
        max_full_bytes = FULL_MAX_BYTES if max_full_bytes is None else max_full_bytes
        if full is None:
            full = need <= max_full_bytes
            if not full:
                chosen = budget_full_names(eng.model, max_full_bytes)
                print(f"calibration: full statistics would take {need / 2**30:.2f} GiB (> {max_full_bytes / 2**30:.2f}"
                      f" GiB): E[x x^T] for {sum(POOLED in n for n in chosen)} MoE layers' pooled expert gate_up "
                      f"and {sum(POOLED not in n for n in chosen)} dense linears, E[x^2] for the rest", file=sys.stderr)
        stats = ActivationStats(full=full)
        stats.full_names = chosen
        ids = eng.tokenizer.encode(text, add_special_tokens=True)
        windows = [ids[i : i + ctx_size] for i in range(0, len(ids), ctx_size) if len(ids[i : i + ctx_size]) > 1]
        if not windows:
            raise ColibriError("the calibration text is empty")
        hooks, wrapped = [], []
        for mname, mod in eng.model.named_modules():
            if isinstance(mod, QLinear):
                key = f"{mname}.weight"
                hooks.append(mod.register_forward_pre_hook(lambda _m, args, key=key: stats.add(key, args[0])))
            elif isinstance(mod, SwitchGLU) and mod.source is not None:
                wrapped.append((mod, mod.source))
                mod.source = _RecordingSource(mod.source, stats, mname)
        try:
            enabled = sys.stderr.isatty() if progress is None else progress
            with tqdm(total=sum(map(len, windows)), unit="tok", desc="calibrating", disable=not enabled,
                      file=sys.stderr) as bar:
                for b in range(0, len(windows), eng.n_slots):
                    group = windows[b : b + eng.n_slots]
                    eng.logits_batch(group)
                    bar.update(sum(map(len, group)))
        finally:
            for h in hooks:
                h.remove()
            for mod, src in wrapped:
                mod.source = src
    stats.source = f"{sum(map(len, windows))} tokens"
    return stats


# ----------------------------------------------------------------------------- weighted quantization


def _requant(wg: Tensor, s: Tensor, m: Tensor, qmax: int) -> tuple[Tensor, Tensor, Tensor]:
    """Round (scale, min) to the stored f16, then the weights against them: (q, scale16, min16)."""
    s16, m16 = s.to(torch.float16), m.to(torch.float16)
    sf = s16.float()
    safe = torch.where(sf > 0, sf, 1.0)
    q = torch.round((wg - m16.float()[..., None]) / safe[..., None]).clamp_(0, qmax)
    return torch.where(sf[..., None] > 0, q, 0.0), s16, m16


def _weighted_err(wg: Tensor, a: Tensor, q: Tensor, s16: Tensor, m16: Tensor) -> Tensor:
    d = q * s16.float()[..., None] + m16.float()[..., None] - wg
    return (a * d * d).sum(-1)  # [rows, G]


def _search_group(wg: Tensor, a: Tensor, qmax: int) -> tuple[Tensor, Tensor, Tensor]:
    """wg [rows, G, g] f32, a [G, g] (or broadcastable) -> q [rows, G, g], scale, min [rows, G] f16."""
    lo, hi = wg.amin(-1), wg.amax(-1)  # [rows, G]
    rng = hi - lo
    best_q, best_s, best_m = _requant(wg, rng / qmax, lo, qmax)  # plain min/max: the baseline candidate
    best_err = _weighted_err(wg, a, best_q, best_s, best_m)
    finite_s = torch.isfinite(best_s.float())
    safe_rng = torch.where(rng > 0, rng, 1.0)
    sa = a.sum(-1).expand_as(lo)  # [rows, G]
    for i in range(NSTEP + 1):
        iscale = (qmax + RMIN + RDELTA * i) / safe_rng  # [rows, G]
        q = torch.round(iscale[..., None] * (wg - lo[..., None])).clamp_(0, qmax)
        # Importance-weighted least squares for w ~ s * q + m over the group.
        aq = a * q
        sq, sq2, sw, sqw = aq.sum(-1), (aq * q).sum(-1), (a * wg).sum(-1), (aq * wg).sum(-1)
        det = sa * sq2 - sq * sq
        ok = det > 1e-12 * sa * sa
        det = torch.where(ok, det, 1.0)
        s = (sa * sqw - sq * sw) / det
        m = (sq2 * sw - sq * sqw) / det
        ok &= (s > 0) & torch.isfinite(s) & torch.isfinite(m)
        q2, s16, m16 = _requant(wg, torch.where(ok, s, 1.0), torch.where(ok, m, 0.0), qmax)
        ok &= torch.isfinite(s16.float()) & torch.isfinite(m16.float()) & (s16.float() > 0)
        err = torch.where(ok, _weighted_err(wg, a, q2, s16, m16), torch.inf)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(better[..., None], q2, best_q)
        best_s, best_m = torch.where(better, s16, best_s), torch.where(better, m16, best_m)
    if not (finite_s.all() and torch.isfinite(best_m.float()).all()):
        raise ValueError("weight has non-finite values or exceeds the f16 range of scale/min")
    return best_q, best_s, best_m


def _check_group_args(w: Tensor, scheme: str, group_size: int, who: str) -> None:
    _check_scheme(scheme)
    if scheme not in _BITS:
        raise ValueError(f"{who} handles the group schemes {tuple(_BITS)}, not {scheme}")
    if not can_quantize(w.shape, scheme, group_size):
        raise ValueError(_shape_error(w.shape, scheme, group_size))


def quantize_weighted(w: Tensor, scheme: str, group_size: int, importance: Tensor | None) -> dict[str, Tensor]:
    """Like `colibri.quant.quantize` for the group schemes (int4/int3/int2), choosing each group's
    scale and min by the importance-weighted search (module docstring). `importance` [in] or None
    (uniform weights: the search then minimises the plain squared error)."""
    _check_group_args(w, scheme, group_size, "quantize_weighted")
    out, n_in = w.shape
    n_groups, qmax = n_in // group_size, (1 << _BITS[scheme]) - 1
    if importance is None:
        a = torch.ones(n_groups, group_size)
    else:
        if tuple(importance.shape) != (n_in,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}, the weight has {n_in} inputs")
        imp = importance.float().clamp_min(0)
        a = (imp + _FLOOR * imp.mean() + 1e-30).view(n_groups, group_size)  # [G, g]
    rows = max(1, _SEARCH_CHUNK_ELEMS // n_in)
    data, scales, mins = [], [], []
    for r in range(0, out, rows):
        wg = w[r : r + rows].float().reshape(-1, n_groups, group_size)  # [rows, G, g]
        if importance is not None:  # llama.cpp's imatrix weighting: E[x^2] times sqrt(sigma^2 + w^2)
            sigma2 = 2 * wg.pow(2).mean((1, 2), keepdim=True)  # [rows, 1, 1]
            q, s, m = _search_group(wg, a * torch.sqrt(sigma2 + wg * wg), qmax)
        else:
            q, s, m = _search_group(wg, a, qmax)
        data.append(_pack(q.to(torch.uint8).reshape(-1, n_in), scheme))
        scales.append(s)
        mins.append(m)
    return {"": torch.cat(data), ".scale": torch.cat(scales), ".min": torch.cat(mins)}


def quantize_gptq(w: Tensor, scheme: str, group_size: int, hessian: Tensor, damp: float = DAMP,
                  block: int = 128) -> dict[str, Tensor]:
    """GPTQ (Frantar et al. 2022) into the canonical group layout: columns are rounded left to right
    and each one's rounding error is spread over the columns not yet rounded, weighted by the inverse
    of `hessian` = E[x x^T] [in, in]. Each group's (scale, min) is chosen by the importance-weighted
    search on the group's error-updated weights when its first column is reached. `damp`: fraction
    of the mean diagonal added to it (keeps a rank-deficient E[x x^T] invertible)."""
    _check_group_args(w, scheme, group_size, "quantize_gptq")
    out, n_in = w.shape
    if tuple(hessian.shape) != (n_in, n_in):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, the weight has {n_in} inputs")
    qmax = (1 << _BITS[scheme]) - 1
    W = w.float().clone()  # [out, in], updated in place as errors propagate
    H = hessian.double().clone()
    dead = H.diagonal() <= 0
    H[dead, dead] = 1.0  # channels that never fire: their weights do not matter
    imp = H.diagonal().float().clone()  # [in]
    H.diagonal().add_(damp * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row j holds the update coefficients for the columns after j.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.empty(out, n_in)
    scales = torch.empty(out, n_in // group_size, dtype=torch.float16)
    mins = torch.empty_like(scales)
    a = imp + _FLOOR * imp.mean() + 1e-30
    block = group_size * max(1, block // group_size)  # whole groups per block
    for b0 in range(0, n_in, block):  # lazy batch updates: columns inside a block first, the rest once
        b1 = min(b0 + block, n_in)
        Wb, Err = W[:, b0:b1].clone(), torch.empty(out, b1 - b0)
        for j in range(b0, b1):
            if j % group_size == 0:
                g = j // group_size
                wg = Wb[:, j - b0 : j - b0 + group_size]  # [out, g], with the errors spread so far
                _, s16, m16 = _search_group(wg[:, None], a[j : j + group_size][None], qmax)
                scales[:, g], mins[:, g] = s16[:, 0], m16[:, 0]
                sf, mf = s16[:, 0].float(), m16[:, 0].float()
                safe = torch.where(sf > 0, sf, 1.0)
            col = Wb[:, j - b0]
            q = torch.where(sf > 0, torch.round((col - mf) / safe).clamp_(0, qmax), 0.0)
            Q[:, j] = q
            err = (col - (q * sf + mf)) / Hinv[j, j]  # [out]
            Wb[:, j - b0 + 1 :] -= err[:, None] * Hinv[j, j + 1 : b1][None]
            Err[:, j - b0] = err
        W[:, b1:] -= Err @ Hinv[b0:b1, b1:]
    return {"": _pack(Q.to(torch.uint8), scheme), ".scale": scales, ".min": mins}


def quantize_calibrated(w: Tensor, scheme: str, group_size: int, stats: ActivationStats, name: str
                        ) -> dict[str, Tensor]:
    """The converter's hook: GPTQ where full statistics exist, the importance-weighted search otherwise."""
    moment = stats.second_moment(name)
    if moment is None:
        stats.unseen.append(name)
    elif len(moment) != w.shape[-1]:
        raise ColibriError(f"calibration statistics for {name} cover {len(moment)} input channels, the weight "
                           f"has {w.shape[-1]} (statistics gathered on another model?)")
    elif moment.dim() == 2:
        try:
            return quantize_gptq(w, scheme, group_size, moment)
        except torch.linalg.LinAlgError:  # E[x x^T] not positive definite even damped (e.g. non-finite)
            moment = moment.diagonal()
    return quantize_weighted(w, scheme, group_size, None if moment is None else moment.float())
