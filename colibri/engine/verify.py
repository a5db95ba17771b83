"""A verify's tokens, from the target's own logits of its rows [next, d1..dk] (row i follows d1..di).

Greedy: row i's argmax is plain decoding's pick after d1..di, so the drafts are taken while they equal those
picks; the first pick that differs, or the pick after the last draft (a bonus), ends the run. The same tokens as
plain decoding.

Sampled: speculative sampling's accept/resample rule (Leviathan et al. 2023, Chen et al. 2023) for a draft that
is one token, not a distribution (every source here proposes one: prompt lookup's copy, a draft model's argmax).
With p_i the target's distribution at row i (the request's temperature, top-k, top-p and min-p applied, as plain
sampling applies them), draft d is kept with probability p_i(d); else the token is drawn from p_i with d removed,
renormalized, and the run ends. So P(d) = p_i(d) and P(x != d) = (1 - p_i(d)) p_i(x) / (1 - p_i(d)) = p_i(x): each
token has the target's distribution whatever the drafts (tests/test_spec_sampling.py checks it on a small
vocabulary). The draws are counter-based like plain sampling's (engine/sampling.py `stream`): the token
j + i of a request takes plain sampling's uniform j + i for its draw, and a second stream of the seed for its
acceptance, so a seeded request gives the same text on every run (not plain decoding's text: the same
distribution).
"""

from __future__ import annotations

import torch

from .sampling import _draw, greedy, kept, sample_with, stream

# The acceptance uniforms are the stream of seed ^ ACCEPT_SALT: independent of the draws' stream of seed.
ACCEPT_SALT = 0x2545F4914F6CDD1D


def greedy_run(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits [k + 1, V] -> the 1..k + 1 tokens of the verify (module doc)."""
    picks: list[int] = []
    for i in range(len(drafts) + 1):
        picks.append(greedy(logits[i]))  # (plain decoding's pick, row by row: the same function)
        if i == len(drafts) or picks[i] != drafts[i]:
            break
    return picks


def sampled_run(logits: torch.Tensor, drafts: list[int], sp, seed: int, taken: int) -> list[int]:
    """logits [k + 1, V] of a request sampled with `sp` (temperature > 0, no logit processors) that has generated
    `taken` tokens -> the 1..k + 1 tokens of the verify (module doc)."""
    k = len(drafts)
    draw_u = stream(seed, taken, k + 1)
    accept_u = stream(seed ^ ACCEPT_SALT, taken, k)
    out: list[int] = []
    for i, d in enumerate(drafts):
        ids, w = kept(logits[i].float() / sp.temperature, sp.top_k, sp.top_p, sp.min_p)  # [n] or [V]
        at = _index(ids, d)
        p_d = 0.0 if at is None else float(w[at]) / float(w.sum(dtype=torch.float64))
        if accept_u[i] < p_d:
            out.append(d)
            continue
        if at is not None:
            w = w.clone()
            w[at] = 0.0  # p with d removed (_draw normalizes)
            if not float(w.sum()) > 0.0:  # every other token's weight rounds to 0: d was certain
                out.append(d)
                continue
        j = _draw(w, draw_u[i])
        out.append(j if ids is None else int(ids[j]))
        return out
    # every draft kept: the bonus token is plain sampling's pick at row k, with its uniform
    out.append(sample_with(logits[k], sp.temperature, sp.top_k, sp.top_p, sp.min_p, draw_u[k]))
    return out


def _index(ids: torch.Tensor | None, tok: int) -> int | None:
    """Where token `tok` sits in kept's weights: itself when every token stays, else its place among `ids`
    (None: the cuts dropped it, so its probability is 0)."""
    if ids is None:
        return tok
    hit = (ids == tok).nonzero()
    return int(hit[0, 0]) if len(hit) else None
