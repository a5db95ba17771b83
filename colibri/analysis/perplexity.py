"""`colibri perplexity`: perplexity of a text under a model, optionally with KL-divergence against a reference.

Windows and scoring (llama.cpp's `llama-perplexity` scheme, generalised to a stride):
- the text is tokenized once, without special tokens; windows of `ctx_size` tokens start every
  `stride` tokens (default `ctx_size`: non-overlapping), and only full windows are used;
- when the tokenizer adds a BOS token, it replaces the first token of every window (as llama.cpp
  does), so each window reads like the start of a document;
- each window scores its last `min(stride, ctx_size // 2)` tokens: by default the second half,
  so every scored token has at least ctx_size / 2 tokens of context; a smaller stride scores every
  token after the first window's head exactly once (context >= ctx_size - stride).
Perplexity = exp(mean negative log-likelihood over the scored tokens).

With a reference (`kl_base`, e.g. the bf16 container of the same model) both engines score the
same windows side by side, one batch of windows at a time: only that batch's logits of each model
are in memory (never the reference's logits for the whole text). KL(P_ref || P_model) per scored
token, top-1 agreement (same argmax) and the perplexity ratio model / reference are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import ColibriError


@dataclass
class KLStats:
    """The model against a reference over the same scored tokens."""

    mean_kl: float  # nats/token, KL(P_ref || P_model)
    max_kl: float
    p99_kl: float
    top1_agreement: float  # share of scored tokens with the same argmax
    ppl_base: float
    ppl_ratio: float  # ppl(model) / ppl(reference)


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood, nats/token
    tokens_scored: int
    windows: int
    ctx_size: int
    stride: int
    seconds: float
    kl: KLStats | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def scored_per_window(ctx_size: int, stride: int) -> int:
    """How many tokens (the window's last ones) each window scores."""
    return min(stride, ctx_size // 2)


def make_windows(ids: list[int], ctx_size: int, stride: int, bos_id: int | None) -> list[list[int]]:
    """Full windows of `ctx_size` tokens every `stride` tokens; the first token replaced by BOS if given."""
    if ctx_size < 2:
        raise ColibriError(f"ctx-size must be at least 2 for perplexity, got {ctx_size}")
    if stride < 1:
        raise ColibriError(f"stride must be at least 1, got {stride}")
    if len(ids) < ctx_size:
        raise ColibriError(f"the text has {len(ids)} tokens, fewer than one window of ctx-size {ctx_size} "
                           "(use a longer text or a smaller --ctx-size)")
    out = []
    for start in range(0, len(ids) - ctx_size + 1, stride):
        w = list(ids[start : start + ctx_size])
        if bos_id is not None:
            w[0] = bos_id
        out.append(w)
    return out


def _bos_id(tokenizer) -> int | None:
    """The id the tokenizer prepends with special tokens on, or None if it adds none at the start."""
    with_sp, without = tokenizer.encode("a", add_special_tokens=True), tokenizer.encode("a", add_special_tokens=False)
    if len(with_sp) > len(without) and with_sp[len(with_sp) - len(without):] == without:
        return with_sp[0]
    return None


def window_logprobs(logits: torch.Tensor, window: list[int], n_score: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [n_score, V] of the window's scored positions and their targets [n_score]."""
    T = len(window)
    pred = logits[T - n_score - 1 : T - 1].float()  # [n, V]: row i predicts token T - n + i
    targets = torch.tensor(window[T - n_score :], dtype=torch.long)  # [n]
    return torch.log_softmax(pred, dim=-1), targets


class _Accumulator:
    """Running sums over scored tokens (NLL of the model, and of the reference plus KL when given)."""

    def __init__(self) -> None:
        self.n, self.nll, self.nll_base, self.kl_sum, self.kl_max, self.agree = 0, 0.0, 0.0, 0.0, 0.0, 0
        self.kls: list[torch.Tensor] = []

    def add(self, lp: torch.Tensor, targets: torch.Tensor, lp_base: torch.Tensor | None) -> None:
        self.n += len(targets)
        self.nll -= lp.double().gather(1, targets[:, None]).sum().item()
        if lp_base is None:
            return
        self.nll_base -= lp_base.double().gather(1, targets[:, None]).sum().item()
        kl = (lp_base.exp() * (lp_base - lp)).double().sum(-1).clamp_min(0.0)  # [n]; clamp: rounding below 0
        self.kl_sum += kl.sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        self.kls.append(kl.float())
        self.agree += int((lp.argmax(-1) == lp_base.argmax(-1)).sum())

    def kl_stats(self) -> KLStats:
        ppl, ppl_base = math.exp(self.nll / self.n), math.exp(self.nll_base / self.n)
        p99 = torch.quantile(torch.cat(self.kls).double(), 0.99).item()
        return KLStats(self.kl_sum / self.n, self.kl_max, p99, self.agree / self.n, ppl_base, ppl / ppl_base)


def _open(model, ctx_size: int, slots: int, engine_kw: dict):
    """(engine, whether we opened it): a path is loaded with `slots` windows per step."""
    from ..api import Engine

    if isinstance(model, Engine):
        if model.ctx_size < ctx_size:
            raise ColibriError(f"the engine's ctx_size {model.ctx_size} is smaller than the window {ctx_size}")
        return model, False
    if not Path(model).exists():
        raise ColibriError(f"model file {model} not found")
    return Engine(model, ctx_size=ctx_size, slots=slots, **engine_kw), True


def perplexity(model, text: str, ctx_size: int = 512, stride: int | None = None, kl_base=None, *,
               slots: int = 4, progress: bool | None = None, **engine_kw) -> PerplexityResult:
    """Perplexity of `text` under `model` (a .coli path or a loaded `Engine`), in windows of `ctx_size`
    tokens every `stride` (default ctx_size) scoring each window's second half (module docstring).

    `kl_base`: a reference (.coli path or Engine, same tokenizer) run on the same windows; the result's
    `kl` then holds mean/max/p99 KL(P_ref || P_model), top-1 agreement and the perplexity ratio.
    `slots`: windows scored per engine step when a path is loaded (each needs a KV slot of ctx_size);
    `engine_kw` goes to `Engine` (threads, placement, mem_budget, ... for models streamed from disk).
    """
    from tqdm import tqdm

    stride = stride or ctx_size
    t0 = time.perf_counter()
    eng, own = _open(model, ctx_size, slots, engine_kw)
    base, own_base = None, False
    try:
        if kl_base is not None:
            base, own_base = _open(kl_base, ctx_size, slots, engine_kw)
            if base.tokenizer.tk.to_str() != eng.tokenizer.tk.to_str():
                raise ColibriError("the model and the --kl-base reference have different tokenizers")
            if base.vocab_rows != eng.vocab_rows:
                raise ColibriError(f"vocabulary sizes differ: {eng.vocab_rows} vs reference {base.vocab_rows}")
        ids = eng.tokenizer.encode(text, add_special_tokens=False)
        windows = make_windows(ids, ctx_size, stride, _bos_id(eng.tokenizer))
        n_score = scored_per_window(ctx_size, stride)
        per_step = eng.n_slots if base is None else min(eng.n_slots, base.n_slots)
        acc = _Accumulator()
        enabled = sys.stderr.isatty() if progress is None else progress
        with tqdm(total=len(windows) * n_score, unit="tok", desc="perplexity", disable=not enabled,
                  file=sys.stderr) as bar:
            for b in range(0, len(windows), per_step):
                group = windows[b : b + per_step]
                logits = eng.logits_batch(group)  # [ctx, V] each
                base_logits = base.logits_batch(group) if base is not None else [None] * len(group)
                for w, lg, blg in zip(group, logits, base_logits, strict=True):
                    lp, targets = window_logprobs(lg, w, n_score)
                    lp_base = window_logprobs(blg, w, n_score)[0] if blg is not None else None
                    acc.add(lp, targets, lp_base)
                del logits, base_logits  # only this batch's logits are ever held
                bar.update(len(group) * n_score)
                bar.set_postfix(ppl=f"{math.exp(acc.nll / acc.n):.4f}")
    finally:
        if own:
            eng.close()
        if own_base and base is not None:
            base.close()
    return PerplexityResult(math.exp(acc.nll / acc.n), acc.nll / acc.n, acc.n, len(windows), ctx_size, stride,
                            time.perf_counter() - t0, acc.kl_stats() if base is not None else None)


def format_result(r: PerplexityResult) -> str:
    lines = [f"perplexity: {r.ppl:.4f} (nll {r.nll:.5f} nats/token) over {r.tokens_scored} tokens in "
             f"{r.windows} windows of {r.ctx_size} (stride {r.stride}), {r.seconds:.1f}s"]
    if r.kl is not None:
        k = r.kl
        lines += [f"reference perplexity: {k.ppl_base:.4f}; ratio {k.ppl_ratio:.4f}",
                  f"KL-divergence vs reference: mean {k.mean_kl:.6f}, p99 {k.p99_kl:.6f}, max {k.max_kl:.6f} "
                  "nats/token",
                  f"top-1 agreement: {k.top1_agreement * 100:.2f}%"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..cli.common import HelpFormatter, add_engine_args, positive, resolve_model, setup_logging

    p = argparse.ArgumentParser(prog="colibri perplexity", formatter_class=HelpFormatter,
                                description="Perplexity of a text file under a model, in windows scoring their "
                                "second half (llama.cpp's scheme); with --kl-base, KL-divergence, top-1 "
                                "agreement and perplexity ratio against a reference container.")
    p.add_argument("--file", "-f", required=True, help="text file to score (tokenized with the model's tokenizer)")
    p.add_argument("--stride", type=positive("--stride"), default=None,
                   help="tokens between window starts (default: --ctx-size, i.e. non-overlapping windows); "
                        "each window scores its last min(stride, ctx-size/2) tokens")
    p.add_argument("--kl-base", default=None, metavar="REF.coli",
                   help="reference container (e.g. the bf16 one): run on the same windows side by side, with the "
                        "default bf16 K/V cache (so that the model's own file with -ctk/-ctv measures the cache)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    add_engine_args(p, ctx_size=512, slots=4)
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    try:
        text = Path(a.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ColibriError(f"cannot read {a.file}: {e}") from None
    model = _engine(a, resolve_model(a))
    base = None
    try:
        if a.kl_base is not None:
            default_kv = (a.cache_type_k, a.cache_type_v) == ("bf16", "bf16")
            if os.path.abspath(a.kl_base) == os.path.abspath(a.model) and default_kv:
                base = model  # the same file: one engine, scored twice
            else:  # (the reference keeps the default K/V cache: the KL then measures -ctk / -ctv too)
                base = _engine(a, a.kl_base, ("bf16", "bf16"))
        r = perplexity(model, text, a.ctx_size, a.stride, base, progress=False if a.no_progress else None)
    finally:
        model.close()
        if base is not None and base is not model:
            base.close()
    print(json.dumps(r.to_dict(), indent=2) if a.json else format_result(r))
    return 0


def _engine(a: argparse.Namespace, path: str, kv: tuple[str, str] | None = None):
    """An engine for `path` with the command's engine and tier flags (`kv`: other K/V cache types)."""
    from ..cli.common import engine_from_args

    if not Path(path).exists():
        raise ColibriError(f"model file {path} not found")
    saved = a.model, a.cache_type_k, a.cache_type_v
    a.model = path
    if kv is not None:
        a.cache_type_k, a.cache_type_v = kv
    try:
        return engine_from_args(a)
    finally:
        a.model, a.cache_type_k, a.cache_type_v = saved
