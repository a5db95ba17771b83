"""Prefill, decode one token, the sampler, and the token generator."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

Sampler = Callable[[torch.Tensor], int]


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> Sampler:
    """logits [V] (f32) -> token id. temperature 0 is greedy."""
    if temperature <= 0:
        return lambda logits: int(torch.argmax(logits))

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
        return int(torch.multinomial(probs, 1, generator=generator))

    return sample


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): shrink the logits of tokens already seen."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    stop_reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of the prefill; decode speed counts the ones after it.
        n = max(self.generated - 1, 0)
        return n / self.decode_s if self.decode_s else 0.0


@torch.inference_mode()
def prefill(model, caches: list, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """One batched forward over the prompt; returns the last position's logits [V]."""
    return model(ids, caches, start, last_only=True)[0]


@torch.inference_mode()
def decode_one(model, caches: list, token: int, pos: int) -> torch.Tensor:
    return model(torch.tensor([token]), caches, pos)[0]


def generate_tokens(model, caches: list, prompt: list[int], max_tokens: int, sampler: Sampler, *,
                    ctx_size: int, eos_ids: set[int] = frozenset(), ignore_eos: bool = False,
                    repeat_penalty: float = 1.0, stats: Stats | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` new tokens; stops at EOS (unless ignored) or when the context is full."""
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt)
    seen = torch.tensor(prompt, dtype=torch.long)
    t0 = time.perf_counter()
    logits = prefill(model, caches, torch.tensor(prompt, dtype=torch.long))
    pos = len(prompt)
    stats.stop_reason = "length"
    for i in range(max_tokens):
        logits = apply_repetition_penalty(logits, seen, repeat_penalty)
        token = sampler(logits)
        now = time.perf_counter()
        if i == 0:
            stats.ttft_s = stats.prefill_s = now - t0
            t_dec = now
        stats.generated += 1
        stats.decode_s = now - t_dec
        yield token
        if token in eos_ids and not ignore_eos:
            stats.stop_reason = "eos"
            return
        if i + 1 == max_tokens:
            return
        if pos >= ctx_size:
            stats.stop_reason = "ctx"
            return
        if repeat_penalty != 1.0:
            seen = torch.cat([seen, torch.tensor([token])])
        logits = decode_one(model, caches, token, pos)
        pos += 1
