"""A draft model: a smaller `.coli` of the same tokenizer, in the same process, proposing each speculating
request's drafts (llama.cpp's `-md`; `Engine(draft_model=...)`, `--draft-model`).

It has its own weights (in RAM, out of the target's `--mem-budget`: `budget_left`), its own decode plan and its
own KV slots, one beside each of the target's, and runs on the engine thread between the target's steps. Each step
it proposes up to k tokens a request: it feeds what of the request's context its slot does not hold yet (the whole
prompt at first, then the last verify's tokens), takes its greedy pick, and then the next picks in one native
multi-step run (or a forward a pick where the plan has none), all requests of the step batched. It stops a
request's drafts where its own probability of its pick falls below `P_MIN` (llama.cpp's `--draft-p-min`): a pick
the draft itself doubts is rarely the target's.

Rollback is the slot's record: `held[slot]` lists the tokens whose K/V the draft's slot holds; the next proposal
keeps the longest prefix of it that the request's context shares and overwrites the rest (a rejected draft, or
another request's tokens in a reused slot). The draft never changes a token the target gives: the target's
verify decides (engine/verify.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import ColibriError
from ..format.container import Container
from ..layers.batch import Seq, StepBatch
from ..models.base import bind, build
from ..store import TieredStore
from .decode_plan import DecodePlan
from .kv import SlotPool, common_prefix, rewinds

# A draft token is proposed while the draft gives it at least this probability (llama.cpp's default 0.75 is tuned
# for large drafts; the tiny ones here are less sure of right tokens: measured on the demo, benchmarks/bench_spec.py)
P_MIN = 0.5
_NO_STOP = torch.zeros(0, dtype=torch.int64)  # (a draft run stops at no token)
GATE_EWMA = 0.2  # weight of a drafted step's new rate
RETRY = 64  # plain steps after which "auto" tries the draft model again where it did not pay (doubling to 4096)
RETRY_MAX = 4096


class DraftGate:
    """Whether "auto" drafts with the draft model: its measured rate (the tokens its verify steps gave per second
    of the draft's and the verify's time together, an EWMA) against plain decoding's (sequences per second of a
    plain step or native run). Unmeasured, it is tried; where it did not pay it is tried again after RETRY plain
    steps (a prompt that turns predictable, a cache that warmed), the wait doubling at each try that still does
    not pay (each try costs a draft catch-up and a verify where drafts lose)."""

    def __init__(self):
        self.rate: float | None = None  # tokens per second of the drafted steps
        self.waited, self.wait = 0, RETRY

    def observe(self, tokens: int, seconds: float) -> None:
        r = tokens / seconds
        self.rate = r if self.rate is None else self.rate + GATE_EWMA * (r - self.rate)

    def pays(self, plain_rate: float) -> bool:
        if self.rate is None or self.rate > plain_rate:
            self.wait = RETRY
            return True
        self.waited += 1
        if self.waited >= self.wait:
            self.waited, self.wait = 0, min(2 * self.wait, RETRY_MAX)
            return True
        return False


def budget_left(path: str | os.PathLike, mem_budget: int) -> int:
    """The target's share of `mem_budget` (bytes for weights) once the draft's weights, all kept in RAM, are out of
    it; a one-line refusal where they take it all."""
    from ..store.sizes import human, model_sizes

    if not Path(path).is_file():
        raise ColibriError(f"draft model file {path} not found")
    with Container(path) as c:
        need = model_sizes(c).total_bytes
    if need >= mem_budget:
        raise ColibriError(f"the draft model's weights ({human(need)}) take all of --mem-budget {human(mem_budget)}; "
                           "raise the budget or use a smaller draft")
    return mem_budget - need


class DraftModel:
    def __init__(self, path: str | os.PathLike, n_slots: int, ctx: int, vocab: dict,
                 dtype_for: Callable[[str], torch.dtype]):
        """`vocab`: the target's token -> id map; the draft's must equal it (its ids are the target's);
        `dtype_for`: a quantization scheme -> the dtype it computes in (the target's rule)."""
        from ..plan import placement_fn
        from ..tokenizer import Tokenizer

        self.path = str(path)
        self.container = c = Container(path)
        try:
            tk = Tokenizer(c.meta.get("tokenizer"), c.config)
            if tk.tk.get_vocab() != vocab:
                raise ColibriError(f"draft model {self.path}: its tokenizer differs from the target's (a draft must "
                                   "share the target's vocabulary)")
            self.dtype = dtype_for(c.quant.get("scheme", "bf16"))
            self.model, _ = build(c.model_type, c.config)
            self.store = TieredStore(c, self.dtype, placement_fn(c, ctx * n_slots), prefetch=False)
        except BaseException:
            c.close()
            raise
        try:
            bind(self.model, self.store)
            self.store.attach(self.model)
            self.model.model.embed_tokens.out_dtype = self.dtype
            self.model.eval()
            self.slots = SlotPool(self.model, n_slots, ctx, self.dtype, self.store.layer_device)
            if not all(rewinds(x) for x in self.slots.caches[0]):
                raise ColibriError(f"draft model {self.path}: a draft must keep K/V by position (not a recurrent "
                                   "state: engine/kv.py `rewinds`)")
            self.plan = DecodePlan(self.model)
        except BaseException:
            self.close()
            raise
        self.held = self.slots.tokens  # per slot: the ids its K/V hold (module doc)
        self.ctx = ctx
        self.forwards = 0  # draft forwards run (each a batch of rows)
        self.p_min = P_MIN  # (module doc; --draft-p-min)

    def propose(self, asks: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """asks: (slot, the request's context up to and including the token it feeds next, k) -> up to k drafts
        each (fewer where the draft doubts its pick, or the slot's context ends)."""
        out: list[list[int]] = [[] for _ in asks]
        live, rows = [], []  # live: ask indices still drafting; rows: their tokens to feed at this depth
        for j, (slot, ctx, k) in enumerate(asks):
            if min(k, self.ctx - len(ctx)) > 0:
                keep = min(common_prefix(self.held[slot], ctx), len(ctx) - 1)  # (its last token fed again)
                del self.held[slot][keep:]
                live.append(j)
                rows.append(ctx[keep:])
        first = True
        while live:
            want = [min(asks[j][2], self.ctx - len(asks[j][1])) - len(out[j]) for j in live]  # drafts still wanted
            room = min(self.ctx - len(self.held[asks[j][0]]) for j in live)  # positions left to write
            if not first and (got := self._run(live, rows, min(max(want), room), asks)) is not None:
                picks_of, fed = got  # fed: the picks the run fed back (all but its last step's)
                for j, feed, picks, n in zip(live, rows, picks_of, want):
                    self.held[asks[j][0]].extend(feed + picks[:fed])
                    out[j].extend(picks[:n])
                return out
            first = False
            picks = self._step(live, rows, asks)
            nxt, nrows = [], []
            for j, feed, (tok, p), n in zip(live, rows, picks, want):
                self.held[asks[j][0]].extend(feed)
                if p >= self.p_min:
                    out[j].append(tok)
                    if n > 1:
                        nxt.append(j)
                        nrows.append([tok])
            live, rows = nxt, nrows
        return out

    def _seqs(self, live: list[int], rows: list[list[int]], asks) -> tuple[list[Seq], list[int]]:
        seqs, toks, r = [], [], 0
        for j, feed in zip(live, rows):
            slot = asks[j][0]
            seqs.append(Seq(r, r + len(feed), len(self.held[slot]), self.slots.caches[slot]))
            toks.extend(feed)
            r += len(feed)
        return seqs, toks

    def _step(self, live: list[int], rows: list[list[int]], asks) -> list[tuple[int, float]]:
        """One forward of the rows: per ask its greedy pick and the draft's probability of it."""
        seqs, toks = self._seqs(live, rows, asks)
        last = torch.from_numpy(np.array([s.r1 - 1 for s in seqs], dtype=np.int64))
        logits = self.plan.step(torch.from_numpy(np.array(toks, dtype=np.int64)), StepBatch(seqs), last)
        self.plan.take_routes()  # (nobody counts the draft's routes)
        self.forwards += 1
        p, pick = torch.softmax(logits.float(), -1).max(-1)  # [len(live)]
        return list(zip(pick.tolist(), p.tolist()))

    def _run(self, live: list[int], rows: list[list[int]], n: int, asks) -> tuple[list[list[int]], int] | None:
        """The next n picks of every ask in one native run (greedy, each pick's log-probability returned), each
        ask's cut where the draft's probability first falls below p_min, and how many picks the run fed back;
        None where the plan has no such run."""
        seqs, toks = self._seqs(live, rows, asks)
        got = self.plan.run_steps(toks, StepBatch(seqs), n, _NO_STOP, None, None, None, [0] * len(live))
        if got is None:
            return None
        steps, _, lps = got
        self.forwards += len(steps)
        out = []
        for t in range(len(live)):
            picks = []
            for s, row in enumerate(steps):
                if lps[s][t] is None or math.exp(lps[s][t][0]) < self.p_min:
                    break
                picks.append(row[t])
            out.append(picks)
        return out, len(steps) - 1

    def close(self) -> None:
        self.store.close()
        self.container.close()
