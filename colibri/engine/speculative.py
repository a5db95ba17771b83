"""Speculative decoding: drafts proposed (prompt lookup, a draft model: engine/draft.py, or the model's own MTP
layer: engine/mtp.py), verified in one step.

A request's decode row [next] becomes [next, d1..dk]. Prompt lookup guesses the k tokens by finding the longest
n-gram (n = 3, 2, 1) that ends its context (prompt + generated) earlier in that context and copying what followed
its most recent occurrence (prompt lookup decoding; transformers' `prompt_lookup_num_tokens`); a draft model
(`drafter`) decodes them itself. One forward computes the k + 1 rows; the target's own logits decide
(engine/verify.py: greedy, the drafts while they equal its picks; sampled, speculative sampling's rule): 1 to
k + 1 tokens per forward, plain decoding's tokens (greedy) or its distribution (sampled).

Rollback: the request's length (`Active.fed`) and its slot's record (`SlotPool.wrote`) advance by the fed token
and the accepted drafts only. The rejected rows' K/V stay in the cache past that length, where attention never
reads (a row reads the positions up to its own) and the next step overwrites them. A recurrent state (linear
attention, Mamba, short convolutions) keeps a snapshot after each verify row and is restored to the last one
kept (layers/linear_attn.py `verify_rows`, `StateCache.rollback`).

Exactness needs a verify's rows to get what they get one at a time, so a model speculates (`Speculator.able`)
where each row is computed alone: the native whole step (its kernels keep a row's accumulators to itself; a layer
whose experts stream sums its slots in the fixed order too), or torch at f32 (whose GEMMs round a row within f32
differently with the step's rows, as they do a batch's). torch at bf16 rounds visibly: on the demo model one of six
random draft patterns changed the 196th of 200 tokens. A sparse attention's top-k selection breaks its ties as one
decode row does (deepseek_v32.py `DSAttention._top`: relu's zero scores tie often).

The gate (`choose`) sets the depth of each lookup verify from measured figures: per draft position the chance it
is accepted (counted per n-gram length by replaying the lookup against every token a request generates, drafted
or not: the request's own counts once it has enough, else the engine's), and the seconds of a step by its rows
(the runner's plain decode step or native run per token for none drafted; an EWMA per row count of the verify
steps, unmeasured counts estimated from their measured neighbours, so that its first picks explore). It picks
the depths maximizing expected tokens per second, 0 (plain decoding, which may then take the native multi-step
runs) included. Where experts stream from disk "auto" does not draft: a draft row routes to experts of its own,
read on a miss (and evicting others), and the look-ahead prefetch predicts one row a sequence; the gate's row
costs do not model that yet ("lookup" and "draft" still draft there). A draft model's depth is its own
confidence's (engine/draft.py `P_MIN`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ColibriError
from ..kernels import native
from ..layers.linear_attn import StateCache
from ..layers.moe import SwitchGLU
from .draft import DraftGate
from .kv import rewinds
from .mtp import Rows as mtp_rows
from .sampling import greedy
from .verify import greedy_run, sampled_run

MODES = ("auto", "off", "lookup", "draft", "mtp")
# The longest n-gram matched first: a longer match is more specific, its continuation more often right.
# Single tokens still match (an identifier, an indentation predicts what follows), but acceptance is counted per
# match length, so the gate gives 1-gram matches the depth they earn, often none. 4+ grams add little: the
# longest 3-gram match already points into the repeated passage.
NGRAM_MAX = 3
DRAFT_MAX = 8  # the default most drafts per verify (submit's draft_max)
CAP = native.MOE_MAX_ROWS  # a verify step stays within the native kernels' rows: so does its draft depth
OWN_SEEN = 16  # a request's own acceptance counts for a position are used once this many proposals reached it
EWMA = 0.25  # weight of a verify step's new timing


def check(mode: object, draft_max: object, has_draft: bool = True, has_mtp: bool = True) -> None:
    """Refuse an unknown mode or depth in one line (Engine.submit; `has_draft`: a draft model is loaded; `has_mtp`:
    the model's MTP layer is)."""
    if mode not in MODES:
        raise ColibriError(f"speculative must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if mode == "draft" and not has_draft:
        raise ColibriError("speculative='draft' needs a draft model: load the engine with draft_model=PATH "
                           "(--draft-model)")
    if mode == "mtp" and not has_mtp:
        raise ColibriError("speculative='mtp' needs the model's multi-token-prediction layer loaded: "
                           "Engine(mtp=True) (--spec mtp)")
    if isinstance(draft_max, bool) or not isinstance(draft_max, int) or not 0 <= draft_max < CAP:
        raise ColibriError(f"draft_max must be an integer in [0, {CAP - 1}], got {draft_max!r}")


# An n-gram's key: its ids packed BITS apiece into one int (vocabularies stay far below 2^21 ids; a collision
# would only propose a wrong draft, which the verify rejects). Ints, not tuples: a 32k-token prompt indexed in
# 15 ms instead of 107 (tuples are objects the garbage collector then walks).
BITS = 21


def _key(gram: list[int]) -> int:
    k = 0
    for t in gram:
        k = k << BITS | t
    return k


class Lookup:
    """One request's context and its n-gram index: for n = 1..NGRAM_MAX, n-gram -> the position just past its most
    recent occurrence that has a token after it. Updated as tokens arrive (NGRAM_MAX dict writes a token), never
    rescanned."""

    def __init__(self, context: list[int]):
        self.tokens: list[int] = []
        self.index: list[dict[int, int]] = [{} for _ in range(NGRAM_MAX + 1)]  # [n]: {n-gram key: position after}
        self.extend(context)

    def extend(self, new: list[int]) -> None:
        """Index toks[j - n : j] -> j for the new positions j (later ones win: the most recent occurrence)."""
        toks = self.tokens
        j0 = len(toks)
        toks.extend(new)
        L = len(toks)
        if L - j0 < 16:  # a token or a few (decoding)
            for j in range(max(j0, 1), L):
                for n in range(1, min(NGRAM_MAX, j) + 1):
                    self.index[n][_key(toks[j - n : j])] = j
            return
        arr = np.asarray(toks, dtype=np.int64)  # a prompt: every position's keys at once
        for n in range(1, NGRAM_MAX + 1):
            lo = max(j0, n)
            key = np.zeros(L - lo, dtype=np.int64)  # [L - lo]
            for m in range(n):
                key = key << BITS | arr[lo - n + m : L - n + m]
            self.index[n].update(zip(key.tolist(), range(lo, L)))

    def propose(self, k: int) -> tuple[int, list[int]]:
        """(n, up to k drafts): what followed the most recent earlier occurrence of the longest n-gram ending the
        context; (0, []) without a match. A copy that reaches the context's end goes on over its own output
        (LZ77's overlapping copy): a match one period back continues the period."""
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(NGRAM_MAX, L), 0, -1):
            j = self.index[n].get(_key(toks[L - n :]))
            if j is not None:
                src = toks[j : j + k]
                return n, [src[i % len(src)] for i in range(k)]
        return 0, []


class Acceptance:
    """Counts per (match length n, draft position i): proposals that reached position i, and of them how many had
    draft i right."""

    def __init__(self):
        self.seen = np.zeros((NGRAM_MAX + 1, CAP), dtype=np.int64)
        self.ok = np.zeros((NGRAM_MAX + 1, CAP), dtype=np.int64)

    def add(self, n: int, drafted: int, accepted: int) -> None:
        self.seen[n, : min(accepted + 1, drafted)] += 1
        self.ok[n, :accepted] += 1

    def gains(self, n: int, k: int) -> np.ndarray:
        """[k]: the expected extra tokens of drafts 1..k under match length n (`expected`)."""
        return expected(self.seen[n, :k], self.ok[n, :k])


def expected(seen: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """[k]: the expected extra tokens of drafts 1..k: products of the acceptance rates of the positions up to each,
    (ok + 1) / (seen + 2) a position (a count of none: 1/2)."""
    return np.cumprod((ok + 1) / (seen + 2))


class RequestSpec:
    """A speculating request's state: its lookup, and the replay that counts its acceptance (`sync`)."""

    def __init__(self, mode: str, draft_max: int, context: list[int], fixed: bool = False):
        self.mode, self.draft_max = mode, draft_max
        # a seeded sampled request: which drafts it verifies must not depend on measured times (the gate's), or
        # its text would depend on the machine (`Speculator.state`)
        self.fixed = fixed
        self.lookup = Lookup(context)
        self.counts = Acceptance()
        self.synced = 0  # generated tokens indexed
        self.shadow: tuple[int, list[int], int] | None = None  # (n, drafts, matched so far) proposed at a token

    def sync(self, generated: list[int], engine: Acceptance, replay: bool = True) -> None:
        """Index the tokens generated since the last call, replaying the lookup on each: the drafts it would
        propose there are matched against the tokens that came, as a verify would match them, and counted
        (`replay` False: indexed only, where no draft could pay: `Speculator.hopeless`)."""
        if not replay:
            self.lookup.extend(generated[self.synced :])
            self.shadow, self.synced = None, len(generated)
            return
        for tok in generated[self.synced:]:
            if self.shadow is not None:
                n, drafts, i = self.shadow
                if drafts[i] == tok and i + 1 < len(drafts):
                    self.shadow = (n, drafts, i + 1)
                else:  # a draft missed, or the last one was right: the verify this replays ends here
                    got = i + (drafts[i] == tok)
                    self.counts.add(n, len(drafts), got)
                    engine.add(n, len(drafts), got)
                    self.shadow = None
            self.lookup.extend([tok])
            if self.shadow is None:
                n, drafts = self.lookup.propose(self.draft_max)
                self.shadow = (n, drafts, 0) if drafts else None
        self.synced = len(generated)

    def gains(self, engine: Acceptance, n: int, k: int) -> np.ndarray:
        """[k]: the expected extra tokens of drafts 1..k of an n-gram match: products of the acceptance rates of
        the positions up to each (own counts where there are enough, else the engine's; a count of none: 1/2)."""
        own = self.counts.seen[n, :k] >= OWN_SEEN
        return expected(np.where(own, self.counts.seen[n, :k], engine.seen[n, :k]),
                        np.where(own, self.counts.ok[n, :k], engine.ok[n, :k]))


class StepCosts:
    """Seconds of a verify step by its rows in all: an EWMA per row count; unmeasured counts linear between their
    measured neighbours (the plain step at the low end), as the deepest measured beyond them (optimistic, so that
    the gate tries them and they get measured)."""

    def __init__(self):
        self.s: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.s.get(rows)
        self.s[rows] = seconds if old is None else old + EWMA * (seconds - old)

    def estimate(self, T: int, plain_s: float) -> Callable[[int], float]:
        """rows -> seconds, for steps of T sequences whose plain step takes plain_s."""
        pts = [(T, plain_s)] + sorted((r, s) for r, s in self.s.items() if r > T)

        def seconds(rows: int) -> float:
            if rows == T:
                return plain_s
            if rows in self.s:
                return self.s[rows]
            for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
                if r0 < rows < r1:
                    return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
            return pts[-1][1]
        return seconds


def choose(gains: list[np.ndarray], rows: int, tokens: float, seconds: Callable[[int], float], cap: int) -> list[int]:
    """The gate: drafts to verify per candidate, given each one's expected extra tokens per draft (gains[j] [k_j],
    non-increasing), a step of `rows` rows giving `tokens` expected tokens without them, and `seconds(rows)`.
    Each draft adds a row; the best m drafts are the m largest gains (a prefix of each candidate's), so the
    depths maximizing expected tokens per second are the best prefix of the merged gains. Ties keep fewer rows."""
    order = sorted((-float(g), j, i) for j, gs in enumerate(gains) for i, g in enumerate(gs))
    best, best_m = tokens / seconds(rows), 0
    for m, (g, _, _) in enumerate(order[: max(cap - rows, 0)], 1):
        tokens -= g
        rate = tokens / seconds(rows + m)
        if rate > best:
            best, best_m = rate, m
    depths = [0] * len(gains)
    for _, j, _ in order[:best_m]:
        depths[j] += 1
    return depths


class Speculator:
    """The engine's side: which requests speculate, their drafts each step (`plan`), the verify (`accept`), the
    measured figures and the counters (metrics)."""

    def __init__(self, able: bool, streamed: bool, ctx: int, slot_caches: list[list] | None = None):
        self.able, self.streamed, self.ctx = able, streamed, ctx  # (module doc)
        # per slot, its recurrent states (rolled back after a verify: layers/linear_attn.py `verify_rows`)
        self.states = [[c for c in caches if isinstance(c, StateCache)] for caches in slot_caches or []]
        if not any(self.states):  # (no recurrent layer: nothing to mark or restore)
            self.states = []
        self.acceptance = Acceptance()
        self.costs = StepCosts()
        self.drafted = self.accepted = self.forwards = 0  # engine-wide: verified drafts, decode forwards
        self.drafter = None  # engine/draft.py DraftModel, where the engine loaded one
        self.mtp = None  # engine/mtp.py MTPHead, where the engine loaded the model's MTP layer
        self.mtp_next: dict[int, tuple[int, list[int]]] = {}  # slot -> (position of the token fed next, its drafts)
        self.mtp_acceptance = Acceptance()  # the MTP layer's verified drafts by position (row 0), for the gate
        self.mtp_depth = DRAFT_MAX  # drafts the layer makes a request (the gate's last depth + 1)
        self.draft_gate = DraftGate()  # (whether "auto" asks the draft model)
        self.draft_s = 0.0  # the draft model's seconds in the step being planned (0: it did not draft)
        self.why_not: str | None = None  # why this model does not speculate (`able` False), for the CLI's warning

    def state(self, a) -> RequestSpec | None:
        """The request's RequestSpec (engine/scheduler.py Active.spec), made at its first decode step; None where
        it cannot speculate: a processor, a grammar, log-probs or prompt scoring; a model that cannot (`able`);
        "auto" where experts stream and no draft model is loaded. Sampled requests speculate with the
        accept/resample rule (engine/verify.py); a seeded one's text depends on which drafts it verified, so it
        takes none where the gate's measured times decide ("auto"), and all its MTP layer makes ("mtp")."""
        if a.spec is None:
            h, p = a.h, a.picker
            fixed = p.sample is not greedy and p.sp.seed is not None
            mode = "off" if (self.streamed and h.speculative == "auto" and self.drafter is None
                             or fixed and h.speculative == "auto") else h.speculative
            able = (self.able and mode != "off" and h.draft_max > 0 and p.run_spec is not None
                    and p.run_procs() is None and p.sp.logprobs is None
                    and h.prompt_logprobs is None and not h.want_logits)
            a.spec = RequestSpec(h.speculative, h.draft_max, h.prompt_ids, fixed) if able else False
        return a.spec or None

    @classmethod
    def of(cls, model: torch.nn.Module, plan, slot_caches: list[list], ctx: int) -> Speculator:
        """For a loaded model: its decode plan (engine/decode_plan.py) and its slots' layer caches (module doc)."""
        nat = plan.native_layers()
        # the native whole step, experts streamed or not (a layer that waits for its reads sums its slots in the
        # fixed order: engine/stream_hook.py)
        alone = plan.tail is not None and nat is not None
        f32 = model.model.embed_tokens.out_dtype == torch.float32
        plain = all(isinstance(c, StateCache) or rewinds(c) for c in slot_caches[0])
        streamed = any(not m.source.holds_all(m.layer) for m in model.modules() if isinstance(m, SwitchGLU))
        sp = cls(plain and (alone or f32), streamed, ctx, slot_caches)
        if not plain:
            sp.why_not = "a layer's cache cannot drop a verify's rejected rows (a cluster stage's)"
        elif not sp.able:
            sp.why_not = ("its layers do not run in the native whole step (not int8/int4 native weights, or a "
                          "recurrent state, or a sparse attention past index_topk positions: --ctx-size at most that "
                          "keeps it dense), and torch at bf16 rounds a verify's rows otherwise than one at a time")
        return sp

    def plan(self, chunks: list, plain_s: float | None) -> bool:
        """Append drafts to the decode chunks (engine/scheduler.py Chunk) of requests that speculate, every row's
        logits kept; whether the step must stay a single step (drafts to verify, or a "lookup" request: it looks
        up every step). A step with prompt rows drafts nothing: its row budget is the prompt's."""
        if any(c.start < c.a.prompt_len for c in chunks):
            self._mark(chunks)
            return False
        hold, cands, asks = False, [], []  # cands: (chunk, its RequestSpec, n, drafts); asks: (chunk, k)
        rows = T = len(chunks)
        self.draft_s = 0.0
        # "auto" asks the draft model while its measured rate beats plain decoding's (measured first)
        draft_pays = None  # (asked once a step, of the first "auto" request that would ask the draft model)
        hopeless = None  # (whether no lookup depth could pay: asked once a step, at the first "auto" request)
        for c in chunks:
            st = self.state(c.a) if c.sample else None
            if st is None:
                continue
            h = c.a.h
            if st.mode == "auto" and hopeless is None:
                hopeless = self.hopeless(T, plain_s, st.draft_max)
            st.sync(h.tokens, self.acceptance, not (st.mode == "auto" and hopeless))
            hold |= st.mode in ("lookup", "draft", "mtp")  # (an MTP request needs every step's hidden states)
            # k + 1 tokens at most come out: no more than are left to generate, at positions inside the context
            k = min(st.draft_max, h.max_tokens - h.stats.generated - 1, self.ctx - 1 - c.start)
            pending = self.mtp_next.pop(c.a.slot, None) if st.mode == "mtp" else None
            if k <= 0:
                continue
            if pending is not None and pending[0] == c.start:  # (the MTP layer's drafts after the last step: gated)
                cands.append((c, st, None, pending[1][:k]))
                continue
            # (lookup under "auto" only where its gate's costs hold: not with experts streamed)
            look = st.mode == "lookup" or (st.mode == "auto" and not self.streamed and not hopeless)
            n, drafts = st.lookup.propose(k) if look else (0, [])
            # a draft model proposes where asked, and under "auto" where the lookup has no full-length match
            if self.drafter is not None and st.mode == "auto" and n < NGRAM_MAX and draft_pays is None:
                draft_pays = plain_s is not None and self.draft_gate.pays(len(chunks) / plain_s)
            if self.drafter is not None and (st.mode == "draft" or (st.mode == "auto" and n < NGRAM_MAX
                                                                    and draft_pays)):
                hold = True
                asks.append((c, k))
            elif drafts:
                cands.append((c, st, n, drafts))
        tokens = float(T)
        if asks:  # (every request's drafts from one forward a depth)
            t0 = time.perf_counter()
            got = self.drafter.propose([(c.a.slot, c.a.spec.lookup.tokens, k) for c, k in asks])
            self.draft_s = time.perf_counter() - t0
            for (c, _), drafts in zip(asks, got):
                rows += _extend(c, drafts[: max(CAP - rows, 0)])
        for c, st, n, drafts in cands:  # "lookup" (and a seeded request's MTP drafts): all, while the rows allow
            if (st.mode == "lookup" or st.fixed) and (d := _extend(c, drafts[: max(CAP - rows, 0)])):
                rows += d
                tokens += float((st.gains(self.acceptance, n, d) if n is not None
                                 else self.mtp_acceptance.gains(0, d)).sum())
        gated = [x for x in cands if x[1].mode in ("auto", "mtp") and not x[1].fixed]
        if gated and plain_s is not None:  # (plain decoding's cost is measured first)
            gains = [st.gains(self.acceptance, n, len(d)) if n is not None else self.mtp_acceptance.gains(0, len(d))
                     for _, st, n, d in gated]
            depths = choose(gains, rows, tokens, self.costs.estimate(T, plain_s), CAP)
            for (c, _, n, drafts), k in zip(gated, depths):
                rows += _extend(c, drafts[:k])
                if n is None:  # (the layer drafts one deeper than the gate last took: its chain costs too)
                    self.mtp_depth = k + 1
        self._mark(chunks)
        return hold or rows > T

    def hopeless(self, T: int, plain_s: float | None, k: int) -> bool:
        """Whether no verify of up to k more rows could beat a plain step of T sequences even with every draft
        kept, by the measured costs (unmeasured row counts are estimated optimistically: not hopeless): where a
        forward costs its compute, as a small model's in RAM, "auto" then skips the lookup's replay and proposals
        (measured on the demo in RAM, they cost "auto" ~5% of plain decoding with no draft verified)."""
        if plain_s is None:
            return False
        seconds = self.costs.estimate(T, plain_s)
        return all((T + m) / seconds(T + m) <= T / plain_s for m in range(1, min(k, CAP - T) + 1))

    def wants_hidden(self, chunks: list) -> bool:
        """Whether the step's last-layer hidden states are needed (a request drafting with the MTP layer)."""
        return self.mtp is not None and any((st := self.state(c.a)) is not None and st.mode == "mtp"
                                            for c in chunks)

    def after_step(self, chunks: list, picks: list, hidden: torch.Tensor, alive: Callable) -> None:
        """The MTP layer over the step's kept rows of its requests (engine/mtp.py) and their next drafts; `picks`:
        the verified tokens per chunk (None: not a verify), `alive(a)`: the request goes on."""
        asks, r0 = [], 0
        for c, got in zip(chunks, picks):
            a, n, r = c.a, len(c.tokens), r0
            r0 += n
            if not alive(a) or not isinstance(st := a.spec, RequestSpec) or st.mode != "mtp":
                continue
            P = a.prompt_len
            if got is not None:  # a verify: its kept rows, each followed by its pick
                nexts = list(got)
            else:
                after = a.h.prompt_ids[c.start + n] if c.start + n < P else a.next_token
                if after is None:
                    continue
                nexts = [*c.tokens[1:], after]
            k = 0 if c.start + n < P else st.draft_max if st.fixed else min(st.draft_max, self.mtp_depth)
            asks.append((a.slot, mtp_rows(a.slot, c.start, list(range(r, r + len(nexts))), nexts, k, a.h,
                                          lambda h=a.h: [*h.prompt_ids, *h.tokens])))
        if asks:
            for (slot, ask), drafts in zip(asks, self.mtp.step(hidden, [x for _, x in asks])):
                self.mtp_next.pop(slot, None)
                if drafts:
                    self.mtp_next[slot] = (ask.start + len(ask.nexts), drafts)

    def _mark(self, chunks: list) -> None:
        """A verify's recurrent states keep a snapshot a row (`accept` restores one); every other sequence's keep
        none (`verify_rows` runs only a verify's rows one position at a time)."""
        for c in chunks if self.states else ():
            for st in self.states[c.a.slot]:
                st.snapshots = [] if c.drafts else None

    def accept(self, c, logits) -> list[int]:
        """The tokens a verified chunk gives (logits [k + 1, V] of its rows; engine/verify.py): greedy, the
        target's picks while they equal the drafts, then its first pick that differs, or its pick after the last
        draft; sampled, speculative sampling's accept/resample rule."""
        drafts, p = c.tokens[1:], c.a.picker
        if p.sample is greedy:
            picks = greedy_run(logits, drafts)
        else:
            picks = sampled_run(logits, drafts, p.sp, p.seed, p.taken)
        for st in self.states[c.a.slot] if self.states else ():  # the states after the rows kept
            st.rollback(len(picks))
        if c.a.spec and c.a.spec.mode == "mtp":
            self.mtp_acceptance.add(0, len(drafts), len(picks) - 1)
        st = c.a.h.stats
        st.drafted += len(drafts)
        st.accepted += len(picks) - 1
        if len(st.draft_reached) < len(drafts):
            st.draft_reached += [0] * (len(drafts) - len(st.draft_reached))
            st.draft_kept += [0] * (len(drafts) - len(st.draft_kept))
        for i in range(len(drafts)):
            st.draft_reached[i] += 1
            st.draft_kept[i] += i < len(picks) - 1
        self.drafted += len(drafts)
        self.accepted += len(picks) - 1
        return picks

    def verified(self, picks: list, seconds: float) -> None:
        """A step with drafts ran in `seconds` and gave the verified requests `picks` (None for the others): the
        draft model's rate, where it drafted in it (DraftGate)."""
        if self.draft_s > 0.0:
            self.draft_gate.observe(sum(len(p) if p else 1 for p in picks), self.draft_s + seconds)

    def forward(self, a, n: int = 1) -> None:
        """Count n decode forwards of a request (tokens per forward: 1 + accepted drafts / forwards)."""
        a.h.stats.forwards += n
        self.forwards += n


def _extend(c, drafts: list[int]) -> int:
    """Put the drafts after the chunk's token; their rows' logits are kept for the verify."""
    if drafts:
        c.tokens = [c.tokens[0], *drafts]
        c.drafts, c.all_rows = len(drafts), True
    return len(drafts)
