"""Sampled speculative decoding (engine/verify.py): the accept/resample rule gives every token the target's
distribution whatever the drafts; a seeded sampled request speculates and gives the same text on every run,
alone or in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import colibri
from colibri.engine.request import SamplingParams
from colibri.engine.sampling import kept
from colibri.engine.verify import sampled_run

V = 6  # a vocabulary small enough to count every pair of tokens
TRIALS = 5000
# chi-square critical value for 35 degrees of freedom (36 pairs) at p = 0.001: a right rule fails 1 in 1000
# seeds; the runs are seeded, so this one either holds or not
CHI2_35 = 66.6


def _markov(seed: int) -> torch.Tensor:
    """A small 'model': logits [V, V] of the next token given the previous one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5


def _target(z: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """p [V]: the distribution plain sampling draws from (temperature and the cuts of `kept`)."""
    ids, w = kept(z / sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    p = torch.zeros(V, dtype=torch.float64)
    if ids is None:
        p += w.double()
    else:
        p[ids] = w.double()
    return p / p.sum()


def _pairs(table: torch.Tensor, sp: SamplingParams, drafts_of, rule) -> np.ndarray:
    """Counts [V, V] of the first two tokens after token 0 over TRIALS seeded verifies of two drafts (a verify
    that gives one token is followed by a plain draw from its row)."""
    counts = np.zeros((V, V), dtype=np.int64)
    rng = np.random.default_rng(7)
    for seed in range(TRIALS):
        d1 = drafts_of(0, seed)
        d2 = drafts_of(d1, seed)
        logits = table[[0, d1, d2]]  # [3, V]: row i follows token 0 and drafts 1..i
        out = rule(logits, [d1, d2], sp, seed)
        if len(out) == 1:
            out.append(int(rng.choice(V, p=_target(table[out[0]], sp).numpy())))
        counts[out[0], out[1]] += 1
    return counts


def _chi2(counts: np.ndarray, table: torch.Tensor, sp: SamplingParams) -> float:
    p0 = _target(table[0], sp)
    want = np.array([[float(p0[a] * _target(table[a], sp)[b]) for b in range(V)] for a in range(V)]) * TRIALS
    mask = want > 0
    assert counts[~mask].sum() == 0  # nothing drawn where the target has no mass (cut by top-k / top-p)
    return float(((counts[mask] - want[mask]) ** 2 / want[mask]).sum())


def _rule(logits, drafts, sp, seed):
    return sampled_run(logits, drafts, sp, seed, 0)


def _accept_all(logits, drafts, sp, seed):
    """A wrong rule (drafts always kept): the control that shows the test can fail."""
    return list(drafts)


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
            SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("sp", SETTINGS, ids=["plain", "top_k", "top_p_min_p"])
def test_the_rule_keeps_the_targets_distribution(sp) -> None:
    """Drafts that are often right (the most likely token), always wrong-ish (a fixed token) or random: the pairs
    of tokens that come out follow the target's own chain."""
    table = _markov(3)
    likely = [int(table[t].argmax()) for t in range(V)]
    sources = {"likely": lambda t, s: likely[t], "fixed": lambda t, s: 5,
               "random": lambda t, s: (t * 7 + s * 13) % V}
    for name, drafts_of in sources.items():
        chi2 = _chi2(_pairs(table, sp, drafts_of, _rule), table, sp)
        assert chi2 < CHI2_35, (name, chi2)
    bad = _chi2(_pairs(table, sp, sources["likely"], _accept_all), table, sp)
    assert bad > 10 * CHI2_35  # the check tells a wrong rule apart


def test_acceptance_follows_the_drafts_probability() -> None:
    """A draft with target probability p is kept about p of the time, and a certain draft always."""
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]] * 2)
    sp = SamplingParams(temperature=1.0)
    p = float(torch.softmax(z[0], 0)[1])
    kept_n = sum(len(sampled_run(z, [1], sp, s, 0)) == 2 for s in range(4000))
    assert abs(kept_n / 4000 - p) < 0.03
    sure = torch.full((2, V), -1e4)
    sure[:, 4] = 0.0
    assert all(sampled_run(sure, [4], sp, s, 0)[0] == 4 for s in range(50))


REPEAT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200] * 3


def test_seeded_sampled_requests_speculate_reproducibly(ckpt) -> None:
    """A seeded sampled request drafts (accepted and rejected) and gives the same text on every run, alone or
    beside another request; a different seed gives other text."""
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=128, threads=2, slots=2) as llm:
        def run(seed, **kw):
            h = llm.submit(REPEAT, 40, temperature=0.8, seed=seed, ignore_eos=True, speculative="lookup", **kw)
            return h.wait(), h

        a, h = run(11)
        b, _ = run(11)
        other = llm.submit([1, 230, 12, 9, 77] * 4, 40, temperature=0.8, seed=5, ignore_eos=True,
                           speculative="lookup")
        c, _ = run(11)
        other.wait()
        d, _ = run(12)
    assert a == b == c and a != d and len(a) == 40
    assert 0 < h.stats.accepted < h.stats.drafted


def test_auto_leaves_a_seeded_sampled_request_plain(ckpt, monkeypatch) -> None:
    """Under "auto" the gate's measured times pick the drafts, and which drafts a sampled request verified decides
    its text: a seeded one drafts nothing there (plain sampling's text for its seed, however the gate is set),
    an unseeded one drafts where the gate says."""
    from colibri.engine import speculative

    monkeypatch.setattr(speculative, "choose", lambda gains, *_: [len(g) for g in gains])  # (every draft pays)
    monkeypatch.setattr(speculative.Speculator, "hopeless", lambda *_: False)
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=128, threads=2) as llm:
        kw = dict(temperature=0.8, seed=11, ignore_eos=True)
        plain = llm.submit(REPEAT, 40, speculative="off", **kw).wait()
        h = llm.submit(REPEAT, 40, speculative="auto", **kw)
        got = h.wait()
        u = llm.submit(REPEAT, 40, speculative="auto", **{**kw, "seed": None})
        u.wait()
    assert got == plain and h.stats.drafted == 0 and u.stats.drafted > 0
