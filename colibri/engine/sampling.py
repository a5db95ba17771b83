"""Per-request token choice: logits processors (bias, penalties, a grammar) then a sampler, with optional
logprobs.

Processors act on what the request asked for and has seen, so generation has no special cases
(mlx-lm's make_logits_processors): the logit bias (OpenAI's), the repetition penalty (the transformers
rule) over a window of the last `repeat_last_n` prompt + generated tokens (llama.cpp's and Ollama's;
-1: all of them), presence/frequency penalties over the generated tokens (the OpenAI rule).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import native, native_sample
from .request import SamplingParams

Processor = Callable[[torch.Tensor], torch.Tensor]  # logits [V] -> logits [V]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): shrink the logits of tokens already seen."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def greedy(logits: torch.Tensor) -> int:
    """The first index of the largest logit (a NaN counts as the largest, as in torch.argmax). On the CPU
    through numpy: torch's argmax over a 32k-50k vocabulary row took 20-30 us, numpy's 2-3 us (per
    sequence and step: 4% of an 8-sequence decode step)."""
    if logits.device.type == "cpu":
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def _nucleus(z: torch.Tensor, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The most likely tokens of softmax(z) [V], most likely first, enough of them that top_p and min_p
    cut within them: (their logits, their ids, their probabilities under the full softmax). A sort of the
    whole vocabulary cost 2.4 ms at 32k tokens and 13 ms at 152k; a top-64 is 0.1 / 0.4 ms and holds
    the nucleus of all but flat distributions (then 512, 4096, then everything)."""
    V = z.shape[0]
    lse = torch.logsumexp(z, 0)
    m = V
    if min_p > 0.0:  # kept: p >= min_p * p_max, i.e. z >= z_max + log(min_p)
        m = max(1, int((z >= z.max() + math.log(min_p)).sum()))
    k = min(64, m) if top_p < 1.0 else m  # min_p alone: its m tokens
    while True:
        vals, ids = torch.topk(z, k)
        p = torch.exp(vals - lse)
        if k == m or float(p.sum(dtype=torch.float64)) >= top_p:  # token k's mass-before reaches top_p
            return vals, ids, p
        k = min(k * 8, m)


_BLOCK = 1024  # _draw's block of a long row


def _draw(p: torch.Tensor, u: float) -> int:
    """Index i with probability p[i] / sum(p) (p [n] >= 0, unnormalized) for a uniform u in [0, 1): u
    against the cumulative sum, in f64 (torch.multinomial cost 0.9 ms at 32k tokens). A long p goes by
    blocks: block sums, then one block's cumulative sum (an f64 cumsum of 152k values took 1.2 ms)."""
    n = len(p)
    if n > _BLOCK * 4:
        full = n // _BLOCK * _BLOCK
        blocks = p[:full].view(-1, _BLOCK).sum(1)  # [n / 1024] (f32 sums of 1024 values each)
        if full < n:
            blocks = torch.cat([blocks, p[full:].sum().reshape(1)])
        b, r = _pick(blocks, u)  # block b, and how far into it the uniform fell
        return b * _BLOCK + _locate(p[b * _BLOCK:(b + 1) * _BLOCK], r)
    return _pick(p, u)[0]


def _pick(p: torch.Tensor, u: float) -> tuple[int, float]:
    """(i, how much of p[i] lies below the draw) for the uniform u against p's cumulative sum."""
    cum = torch.cumsum(p, 0, dtype=torch.float64)  # [n]
    total = float(cum[-1])
    if not total > 0.0 or math.isinf(total):
        raise ValueError(f"cannot sample: the probabilities sum to {total} (NaN or infinite logits?)")
    r = u * total
    i = int(torch.searchsorted(cum, torch.tensor([r], dtype=torch.float64), right=True))
    while i > 0 and (i >= len(p) or p[i] == 0):  # never a zero-probability entry (r at the very top)
        i -= 1
    return i, r - (float(cum[i - 1]) if i else 0.0)


def _locate(p: torch.Tensor, r: float) -> int:
    """The entry of p (a block) whose cumulative span holds r; the last nonzero one if rounding put r
    past the block's own sum."""
    cum = torch.cumsum(p, 0, dtype=torch.float64)
    i = min(int(torch.searchsorted(cum, torch.tensor([r], dtype=torch.float64), right=True)), len(p) - 1)
    while i > 0 and p[i] == 0:
        i -= 1
    return i


def kept(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
         ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a sampler may pick from logits z [V] (already divided by the temperature) and their
    weights: (ids [n] most likely first, p [n]), or (None, weights [V]) when every token stays. top_k
    keeps the k most likely (renormalized over them), then top_p drops a token once the probability
    mass before it reaches top_p (the first always stays), then min_p drops tokens less likely than
    min_p times the most likely one (as in transformers, vLLM and llama.cpp). z may be overwritten."""
    V = z.shape[0]
    if 0 < top_k < V:
        vals, ids = torch.topk(z, top_k)  # [k], most likely first
        p = torch.softmax(vals, 0)
    elif top_p < 1.0 or min_p > 0.0:
        vals, ids, p = _nucleus(z, top_p, min_p)
    else:  # in place: no more [V] buffers
        return None, z.sub_(z.max()).exp_()
    n = len(p)
    if top_p < 1.0 and n > 1:
        before = torch.cumsum(p, 0, dtype=torch.float64)[:-1]  # the mass before tokens 1..n-1
        n = 1 + int((before < top_p).sum())
    if min_p > 0.0:
        n = max(1, min(n, int((p >= min_p * p[0]).sum())))
    return ids[:n], p[:n]


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, min_p: float = 0.0) -> Callable[[torch.Tensor], int]:
    """logits [V] (f32) -> token id. temperature 0 is greedy; else logits / temperature, the cuts of
    `kept`, and one uniform of `generator` (`uniform`) per token, drawn by the native kernel where it is
    loaded (kernels/sample.c: the same rule; the engine's multi-step native runs use it too) or here."""
    if temperature <= 0:
        return greedy

    def sample(logits: torch.Tensor) -> int:
        return sample_with(logits, temperature, top_k, top_p, min_p, uniform(generator))

    return sample


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def stream(seed: int, start: int, n: int) -> list[float]:
    """Uniforms number start..start+n-1 in [0, 1) of the stream of `seed` (splitmix64 of seed + (i + 1) x
    the golden ratio, 53 bits): counter-based, so a request's token j gets the same uniform in a single
    step, in a native run that takes several ahead, alone or in a batch."""
    i = np.arange(start + 1, start + n + 1, dtype=np.uint64)
    z = np.uint64(seed) + i * _GOLDEN  # (uint64 arrays wrap around: the intended mod 2^64)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return ((z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53).tolist()


def uniform(generator: torch.Generator | None) -> float:
    """The request's next uniform in [0, 1): one per sampled token, wherever it is sampled."""
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def sample_with(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """The token for logits [V] and the uniform u (see make_sampler). A GPU row comes to the host first
    (~0.6 MB at 152k tokens): the same sampler, so the same token, on every tier."""
    x = logits.float().cpu().contiguous()
    if native.available():
        return native_sample.sample(x, temperature, top_k, top_p, min_p, u)
    ids, p = kept(x / temperature, top_k, top_p, min_p)
    i = _draw(p, u)
    return i if ids is None else int(ids[i])


@dataclass
class RunProcs:
    """A request's logit processors as a native run applies them (kernels/procs.c), `processed`'s rules: the
    bias; the repetition penalty over the last `window` tokens (< 0: all), of which `history` holds those the
    run's first step can reach; the presence / frequency penalties over the generated tokens' `counts`."""

    bias: dict[int, float]
    repeat_penalty: float
    window: int
    history: list[int]
    presence: float
    frequency: float
    counts: dict[int, int]


class TokenPicker:
    """One request's processors + sampler, and the history they need."""

    def __init__(self, sp: SamplingParams, prompt_ids: list[int], constraint=None):
        self.sp = sp
        self.constraint = constraint  # a grammar (engine/grammar.py): applied last, so nothing lifts its -inf
        # The uniform of generated token j is stream(seed, j) (unseeded: a seed from the OS), not a generator's
        # next draw: a native run takes those of its steps ahead, and nothing has to be given back.
        self.seed = sp.seed if sp.seed is not None else secrets.randbits(63)
        self.taken = 0  # tokens generated so far
        if sp.temperature > 0:
            self.sample = lambda logits: sample_with(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                                     stream(self.seed, self.taken, 1)[0])
        else:
            self.sample = greedy
        # prompt + generated tokens, for the repetition penalty's window (None: no penalty)
        self.history = list(prompt_ids) if sp.repeat_penalty != 1.0 and sp.repeat_last_n != 0 else None
        self.counts: dict[int, int] = {}  # generated token -> times (presence/frequency penalties)
        bias = sp.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long) if bias else None  # [B]
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None  # [B]

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        sp = self.sp
        if self.bias_ids is not None:
            logits = logits.clone()
            logits[self.bias_ids] += self.bias.to(logits.dtype)
        if self.history:
            window = self.history[-sp.repeat_last_n:] if sp.repeat_last_n > 0 else self.history
            logits = apply_repetition_penalty(logits, torch.tensor(window, dtype=torch.long), sp.repeat_penalty)
        if self.counts and (sp.presence_penalty or sp.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            n = torch.tensor(list(self.counts.values()), dtype=logits.dtype)
            logits = logits.clone()
            logits[ids] -= sp.presence_penalty + sp.frequency_penalty * n
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return logits

    def pick(self, logits: torch.Tensor) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """logits [V] f32 of the model -> (token, its logprob, top alternatives) and record the token."""
        tok = self.sample(self.processed(logits))
        lp = top = None
        if self.sp.logprobs is not None:
            lp, top = token_logprobs(logits, tok, self.sp.logprobs)
        self.took(tok)
        return tok, lp, top

    def took(self, tok: int) -> None:
        """Record a token picked (by `pick`, or by a native run where `run_spec`)."""
        self.taken += 1
        if self.history is not None:
            self.history.append(tok)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        if self.constraint is not None:
            self.constraint.accept(tok)

    @property
    def run_spec(self) -> tuple[float, int, float, float] | None:
        """(temperature, top_k, top_p, min_p) when the token depends on the logits after `run_procs` and one
        uniform alone (no grammar): what coli_decode_run picks itself (temperature 0: the argmax), with the
        log-probs the request asks for; else None."""
        if self.constraint is not None:
            return None
        sp = self.sp
        if self.sample is greedy:
            return (0.0, 0, 1.0, 0.0)
        return (sp.temperature, sp.top_k, sp.top_p, sp.min_p)

    def run_procs(self) -> RunProcs | None:
        """The processors a native run applies before its picks (None: none applies)."""
        sp = self.sp
        pen = bool(sp.presence_penalty or sp.frequency_penalty)
        if self.bias_ids is None and self.history is None and not pen:
            return None
        window = sp.repeat_last_n
        hist = self.history or []
        return RunProcs(dict(sp.logit_bias or {}), sp.repeat_penalty, window if self.history is not None else 0,
                        hist[-window:] if window > 0 else list(hist), sp.presence_penalty, sp.frequency_penalty,
                        dict(self.counts) if pen else {})

    def uniforms(self, n: int) -> list[float]:
        """The uniforms of this request's next n sampled tokens (a native run's, taken ahead)."""
        return stream(self.seed, self.taken, n)


def token_logprobs(logits: torch.Tensor, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `tok` and its `n_top` (<= 20) most likely tokens, from logits [V]: where
    the kernels load, kernels/logprobs.c, which native runs call too (the same values either way)."""
    if native.available() and n_top <= 20:
        return native_sample.logprobs(logits.float().cpu().contiguous(), tok, n_top)
    logp = torch.log_softmax(logits.float(), -1)
    top: list[tuple[int, float]] = []
    if n_top > 0:
        v, i = torch.topk(logp, min(n_top, logp.shape[-1]))
        top = list(zip(i.tolist(), v.tolist()))
    return float(logp[tok]), top


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, n_top: int
                    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """logits [R, V] predicting targets [R] -> per row the target's logprob and the top n alternatives."""
    logp = torch.log_softmax(logits.float(), -1)  # [R, V]
    lps = logp.gather(1, targets[:, None])[:, 0].tolist()
    if n_top <= 0:
        return lps, [[] for _ in lps]
    v, i = torch.topk(logp, min(n_top, logp.shape[-1]), dim=-1)  # [R, n]
    return lps, [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
