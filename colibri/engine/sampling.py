"""Per-request token choice: logits processors (bias, penalties, a grammar) then a sampler, with optional
logprobs.

Processors act on what the request asked for and has seen, so generation has no special cases
(mlx-lm's make_logits_processors): the logit bias (OpenAI's), the repetition penalty over prompt +
generated tokens (the transformers rule), presence/frequency penalties over the generated tokens
(the OpenAI rule).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, min_p: float = 0.0) -> Callable[[torch.Tensor], int]:
    """logits [V] (f32) -> token id. temperature 0 is greedy. After temperature: top_k, then top_p, then
    min_p (a token stays if its probability is at least min_p times the most likely one's, as in
    transformers, vLLM and llama.cpp)."""
    if temperature <= 0:
        return greedy

    def sample(logits: torch.Tensor) -> int:
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            drop = probs.cumsum(-1) - probs >= top_p
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
        probs = torch.softmax(logits, -1)
        if min_p > 0.0:
            probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)  # (multinomial renormalizes)
        return int(torch.multinomial(probs, 1, generator=generator))

    return sample


class TokenPicker:
    """One request's processors + sampler, and the history they need."""

    def __init__(self, sp: SamplingParams, prompt_ids: list[int], constraint=None):
        self.sp = sp
        self.constraint = constraint  # a grammar (engine/grammar.py): applied last, so nothing lifts its -inf
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        self.sample = make_sampler(sp.temperature, sp.top_k, sp.top_p, gen, sp.min_p)
        self.seen = torch.tensor(prompt_ids, dtype=torch.long) if sp.repeat_penalty != 1.0 else None
        self.counts: dict[int, int] = {}  # generated token -> times (presence/frequency penalties)
        bias = sp.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long) if bias else None  # [B]
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None  # [B]

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        sp = self.sp
        if self.bias_ids is not None:
            logits = logits.clone()
            logits[self.bias_ids] += self.bias.to(logits.dtype)
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, sp.repeat_penalty)
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
        """Record a token picked (by `pick`, or by the native greedy loop where `plain_greedy`)."""
        if self.seen is not None:
            self.seen = torch.cat([self.seen, torch.tensor([tok])])
        self.counts[tok] = self.counts.get(tok, 0) + 1
        if self.constraint is not None:
            self.constraint.accept(tok)

    @property
    def plain_greedy(self) -> bool:
        """The token is the raw logits' argmax and nothing else is asked of them (no processor, no
        logprobs): what coli_decode_run computes itself."""
        sp = self.sp
        return self.sample is greedy and self.bias_ids is None and self.seen is None and self.constraint is None \
            and not sp.presence_penalty and not sp.frequency_penalty and sp.logprobs is None


def token_logprobs(logits: torch.Tensor, tok: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `tok` and its `n_top` most likely tokens, from logits [V]."""
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
