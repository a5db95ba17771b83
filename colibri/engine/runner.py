"""The engine thread: admit, run one batched forward over the step's rows, pick tokens, repeat.

It is the only thread that touches torch and the model (so the weight store, the expert cache
and the KV slots need no locks); callers reach it through `Scheduler.submit` and read their
`RequestHandle`s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ColibriError
from ..kernels import native
from ..layers.batch import Seq, StepBatch
from ..layers.moe import SwitchGLU
from .decode_plan import DecodePlan
from .request import EngineClosedError, TokenEvent
from .sampling import prompt_logprobs
from .scheduler import Active, Chunk, Scheduler
from .speculative import Speculator
from .stats import EngineCounters, StepInfo, batching_counts
from .threads import DecodeThreads

log = logging.getLogger("colibri")

# Requests without processors decode this long per native call (`Runner._run`); 0 turns it off. 50 ms, not
# 20: a step of 8 sequences (~15 ms on the 0.44b model) then runs 3 a call instead of one, each single
# step paying ~1 ms of Python (docs/BENCHMARKS.md, "Runs of batched steps").
RUN_S = 0.05


def _ids(ids: list[int]) -> torch.Tensor:
    """int64 [n] from a list: through numpy, ~2 us where torch.tensor takes ~7 (two a step)."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


class Runner:
    def __init__(self, model: torch.nn.Module, plan: DecodePlan, sched: Scheduler, store, threads: int,
                 eos_ids: Callable[[], set]):
        self.model, self.plan, self.sched, self.store, self.threads = model, plan, sched, store, threads
        self.eos_ids = eos_ids
        self.n_experts = {m.layer: m.num_experts for m in model.modules() if isinstance(m, SwitchGLU)}
        self.listeners: list[Callable[[StepInfo], None]] = []
        self.counters = EngineCounters()
        self.decode_threads = DecodeThreads(threads)
        self._threads_now = (threads, threads)  # (torch, native pool)
        self._step_s: dict[int, float] = {}  # decode rows -> the last such step's seconds (sizes `_run`)
        self.run_s: float | None = None  # seconds per native run (Engine's decode_run_ms); None: RUN_S
        self.spec = Speculator.of(model, plan, sched.slots.caches, sched.slots.ctx)  # drafts, gate, verify
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="colibri-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        native.set_threads(self.threads)
        with torch.inference_mode():
            while not self._stop.is_set():
                if not self.sched.wait_for_work(0.5):
                    continue
                self.sched.admit()
                chunks = self.sched.plan()
                if chunks:
                    self._step(chunks)

    def _set_threads(self, n: int, small: bool) -> None:
        """A small step (decode rows) runs its heavy work in the native kernels: their pool gets the
        threads, torch one (its few ops are tiny). A large step (prefill) runs torch's GEMMs: torch gets
        them, the pool one. Both at once would have two sets of threads spin-waiting for the same
        cores (measured: native GEMVs 4x slower next to torch's OpenMP team in a prefill)."""
        want = (1, n) if small and native.available() else (n, 1)
        if want != self._threads_now:
            torch.set_num_threads(want[0])
            native.set_threads(want[1])
            self._threads_now = want

    def _step(self, chunks: list[Chunk]) -> None:
        # Drafts first (they add rows); none while listeners watch: they would take draft rows for fed tokens.
        try:
            hold = not self.listeners and self.spec.plan(chunks, self._step_s.get(len(chunks)))
        except Exception as e:  # noqa: BLE001 - as a failed step: its requests end, the engine goes on
            self._failed(chunks, e)
            return
        decode_only = all(len(c.tokens) == 1 for c in chunks)
        n_threads = self.decode_threads.pick(len(chunks)) if decode_only else self.threads
        self._set_threads(n_threads, sum(len(c.tokens) for c in chunks) <= native.MOE_MAX_ROWS)
        if decode_only and not hold and self._run(chunks, n_threads):
            return
        t0 = time.perf_counter()
        seqs, tokens, out_rows, r = [], [], [], 0
        for c in chunks:
            n = len(c.tokens)
            seqs.append(Seq(r, r + n, c.start, self.sched.slots.caches[c.a.slot]))
            tokens.extend(c.tokens)
            if c.all_rows:
                out_rows.extend(range(r, r + n))
            elif c.sample:
                out_rows.append(r + n - 1)
            r += n
        bytes0, wait0 = self._bytes_read(), self.store.io_wait_s()
        hidden = None  # [T, H]: the last layer's output, where the MTP layer drafts from it (engine/mtp.py)
        try:
            batch = StepBatch(seqs)
            if self.spec.wants_hidden(chunks):
                logits, hidden = self.plan.step_hidden(_ids(tokens), batch, _ids(out_rows))
            else:
                logits = self.plan.step(_ids(tokens), batch, _ids(out_rows))  # [len(out_rows), V]
        except BaseException as e:  # noqa: BLE001 - handed to the requests of the step, the engine goes on
            self._failed(chunks, e)
            return
        routes = self.plan.take_routes()
        now = time.perf_counter()
        for c in chunks:
            self.sched.slots.wrote(c.a.slot, c.start, c.tokens)
        if decode_only:
            # (the threads' choice by compute time: waits on reads do not depend on it, and they vary widely)
            self.decode_threads.record(len(chunks), n_threads, now - t0 - (self.store.io_wait_s() - wait0))
            self._step_s[len(chunks)] = now - t0
        elif any(c.drafts for c in chunks):
            self.spec.costs.observe(r, now - t0)
        outs, o = [], 0
        for c in chunks:
            n_out = len(c.tokens) if c.all_rows else int(c.sample)
            outs.append(logits[o : o + n_out])  # [n_out, V]
            o += n_out
        # A verify's tokens, then counters and listeners: the store counts the tokens a step gives, and a
        # request's stats and routing are complete when it ends.
        picks = [self.spec.accept(c, out) if c.drafts else None for c, out in zip(chunks, outs)]
        self.spec.verified(picks, now - t0)
        self._account(chunks, seqs, routes, bytes0, now - t0, sum(len(p) - 1 for p in picks if p))
        for c, out, got in zip(chunks, outs, picks):
            try:
                if got is None:
                    self._after(c, out, now)
                else:
                    self._verified(c, got, now)
            except Exception as e:  # noqa: BLE001 - one request's picking failed: it ends, the others go on
                self._request_failed(c, e)
        if hidden is not None:
            try:
                self.spec.after_step(chunks, picks, hidden, lambda a: a in self.sched.active and not a.final)
            except Exception as e:  # noqa: BLE001 - as a failed step: its requests end, the engine goes on
                self._failed([c for c in chunks if c.a in self.sched.active], e)

    def _run(self, chunks: list[Chunk], n_threads: int) -> bool:
        """Decode requests that need nothing of a step but its token (greedy or sampled, with a logit bias,
        penalties and log-probs or not, without a grammar: `TokenPicker.run_spec`, `run_procs`) several steps in
        one native call (coli_decode_run)
        when nothing else waits and no listener watches each step: the Python of a step (scheduling,
        counters, the tokens' hand-off) is then paid once per RUN_S of decoding instead of per step. Same
        kernels, same picks (a sampled row takes the uniforms of its next tokens ahead: sampling.stream),
        same tokens and stops; the tokens reach the callers a run at a time. Whether it ran."""
        T = len(chunks)
        if self.listeners or self.sched.queue or self.decode_threads.exploring(T):
            return False
        n = max(int((RUN_S if self.run_s is None else self.run_s) / self._step_s.get(T, 1.0)), 1)
        stops: set[int] = set()
        specs, procs, lps = [], [], []
        for c in chunks:
            a, h = c.a, c.a.h
            spec = a.picker.run_spec
            if c.start < a.prompt_len or not c.sample or c.all_rows or spec is None:
                return False
            specs.append(spec)
            procs.append(a.picker.run_procs())
            lps.append(a.picker.sp.logprobs)
            n = min(n, h.max_tokens - h.stats.generated, self.sched.slots.ctx - a.fed)
            stops |= h.stop_ids if h.ignore_eos else h.stop_ids | self.eos_ids()
        if n < 2:
            return False
        sampled = any(sp[0] > 0 for sp in specs)
        seqs = [Seq(r, r + 1, c.start, self.sched.slots.caches[c.a.slot]) for r, c in enumerate(chunks)]
        t0, bytes0 = time.perf_counter(), self._bytes_read()
        try:
            got = self.plan.run_steps([c.tokens[0] for c in chunks], StepBatch(seqs), n,
                                      _ids(sorted(stops)), specs if sampled else None,
                                      [c.a.picker.uniforms(n) if sp[0] > 0 else [] for c, sp in zip(chunks, specs)],
                                      procs if any(p is not None for p in procs) else None,
                                      lps if any(n is not None for n in lps) else None)
        except BaseException as e:  # noqa: BLE001 - as in _step
            self._failed(chunks, e)
            return True
        if got is None:
            return False
        steps, idx, logprobs = got
        now = time.perf_counter()
        self._step_s[T] = (now - t0) / len(steps)
        self.decode_threads.record(T, n_threads, self._step_s[T])
        self._account_run(chunks, idx, bytes0, now - t0)
        for t, c in enumerate(chunks):  # a row's tokens up to its own stop (the run ends at anyone's)
            toks = [row[t] for row in steps]
            self.sched.slots.wrote(c.a.slot, c.start, [c.tokens[0], *toks[:-1]])
            for s, tok in enumerate(toks):
                c.a.fed += 1
                c.a.picker.took(tok)
                lp, top = logprobs[s][t] if logprobs is not None and logprobs[s][t] is not None else (None, None)
                if not self._took(c.a, tok, lp, top, now):
                    break
            self.spec.forward(c.a, c.a.fed - c.start)  # (a forward per token taken)
        return True

    def _request_failed(self, c: Chunk, e: Exception) -> None:
        """A request whose own processing after the step raised (its sampler, its processors): it ends with the
        error; its slot's cache holds what the step wrote, which its end discards."""
        if not isinstance(e, ColibriError):
            log.exception("colibri: request %s failed after its step", c.a.h.id)
        if c.a in self.sched.active:
            self.sched.finish(c.a, "error", e)

    def _failed(self, chunks: list[Chunk], e: BaseException) -> None:
        self.plan.take_routes()
        for c in chunks:  # what the step wrote is unknown
            self.sched.slots.forget(c.a.slot, c.start)
        if not isinstance(e, ColibriError | MemoryError):
            log.exception("colibri: engine step failed")
        for c in chunks:
            self.sched.finish(c.a, "error", e)
        if self.plan.failed(e):  # a cluster stage died with its K/V: every request in flight ends
            for a in list(self.sched.active):
                self.sched.slots.forget(a.slot)
                self.sched.finish(a, "error", e)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise e

    def _after(self, c: Chunk, logits: torch.Tensor, now: float) -> None:
        """Feed the chunk's results back to its request: prompt scores, then the next token."""
        a, h = c.a, c.a.h
        a.fed += len(c.tokens)
        if a.final:
            self.sched.finish(a, "length")
            return
        if c.start < a.prompt_len:  # a prompt chunk
            if h.want_logits:
                a.logits_parts.append(logits.clone())
            if h.prompt_logprobs is not None:
                self._score_prompt(a, c, logits)
            if a.prefilling:
                return
            h.stats.prefill_s = now - h.submitted_at - h.stats.queued_s
            if h.want_logits:
                h.logits = torch.cat(a.logits_parts) if len(a.logits_parts) > 1 else a.logits_parts[0]
                a.logits_parts = []
            if h.max_tokens == 0:
                self.sched.finish(a, "length")
                return
        else:
            self.spec.forward(a)
        self._took(a, *a.picker.pick(logits[-1]), now)

    def _verified(self, c: Chunk, toks: list[int], now: float) -> None:
        """A verify's tokens (`Speculator.accept`): the accepted drafts and the model's own next token go out one by
        one through `_took`, so stops, max_tokens and the context's end act inside the run. The slot keeps the fed
        token and the accepted drafts; the rejected rows' K/V stay past the request's length, where attention
        never reads, and the next step overwrites them (engine/speculative.py)."""
        a = c.a
        self.spec.forward(a)
        self.sched.slots.wrote(a.slot, c.start, c.tokens[: len(toks)])
        for tok in toks:
            a.fed += 1  # row i's pick follows the fed token and drafts 1..i, now in the cache
            a.picker.took(tok)
            if not self._took(a, tok, None, None, now) or a.final:
                break

    def _took(self, a: Active, tok: int, lp: float | None, top: list | None, now: float) -> bool:
        """A token picked for `a` after its cache took `a.fed` tokens: emit it, or end the request;
        whether it goes on."""
        h = a.h
        st = h.stats
        if st.generated == 0:
            st.ttft_s = now - h.submitted_at
            a.first_at = now
        if tok in h.stop_ids or (not h.ignore_eos and tok in self.eos_ids()):
            st.decode_s = now - a.first_at
            self.sched.finish(a, "stop")
            return False
        st.generated += 1
        st.decode_s = now - a.first_at
        self.counters.generated_tokens += 1
        h._emit(TokenEvent(tok, lp, top))
        if st.generated >= h.max_tokens:
            if self.listeners and a.fed < self.sched.slots.ctx:  # route listeners see the last token too
                a.next_token, a.final = tok, True
            else:
                self.sched.finish(a, "length")
                return False
        elif a.fed >= self.sched.slots.ctx:  # no position left to feed the token just made
            self.sched.finish(a, "ctx")
            return False
        else:
            a.next_token = tok
        return True

    def _score_prompt(self, a: Active, c: Chunk, logits: torch.Tensor) -> None:
        """Row t of the chunk predicts prompt token c.start + t + 1 (the last row may predict the first
        generated token: not a prompt score)."""
        h, P = a.h, a.prompt_len
        if h.prompt_token_logprobs is None:
            h.prompt_token_logprobs, h.prompt_top_logprobs = [None], [None]
        targets = h.prompt_ids[c.start + 1 : min(c.start + len(c.tokens) + 1, P)]
        if targets:
            lps, tops = prompt_logprobs(logits[: len(targets)], torch.tensor(targets), h.prompt_logprobs)
            h.prompt_token_logprobs.extend(lps)
            h.prompt_top_logprobs.extend(tops)

    # ------------------------------------------------------------------ counters and listeners

    def _bytes_read(self) -> int:
        return self.store.bytes_read()

    def _account(self, chunks: list[Chunk], seqs: list[Seq], routes: dict, bytes0: int, seconds: float,
                 accepted: int = 0) -> None:
        """`accepted`: drafts the step's verifies accepted (the store counts a step's decode tokens: one a sequence,
        plus those)."""
        k = self.counters
        k.steps += 1
        k.rows += seqs[-1].r1
        decode = [c for c in chunks if c.start >= c.a.prompt_len]
        decode_rows = sum(len(c.tokens) for c in decode)  # (a verify's drafts too)
        k.decode_rows += decode_rows
        k.busy_s += seconds
        read = self._bytes_read() - bytes0
        self.store.count_step(seqs[-1].r1 - decode_rows, len(decode) + accepted, read)
        bounds = [(s.r0, s.r1) for s in seqs]
        unique, summed, own = batching_counts(routes, bounds) if routes else ({}, {}, [0] * len(seqs))
        total_unique = sum(unique.values())
        k.experts_unique += total_unique
        k.experts_summed += sum(summed.values())
        n = len(chunks)
        for c, mine in zip(chunks, own):
            st = c.a.h.stats
            st.experts_own += mine
            st.experts_fetched_share += total_unique / n
            st.bytes_read_share += read / n
        if self.listeners:
            rows, seq_rows = [], []
            for c, s in zip(chunks, seqs):
                rows.extend((c.a.h.id, c.start + t, tok) for t, tok in enumerate(c.tokens))
                seq_rows.append((c.a.h.id, s.r0, s.r1))
            kinds = {c.start >= c.a.prompt_len for c in chunks}
            kind = "mixed" if len(kinds) == 2 else ("decode" if True in kinds else "prefill")
            info = StepInfo(rows, routes, unique, summed, seq_rows, read, seconds, kind)
            for fn in list(self.listeners):
                try:
                    fn(info)
                except Exception:  # noqa: BLE001 - a listener must not take the engine down
                    log.exception("colibri: step listener failed; removing it")
                    self.listeners.remove(fn)

    def _account_run(self, chunks: list[Chunk], idx: torch.Tensor, bytes0: int, seconds: float) -> None:
        """`_account` for a `_run` of n steps of T one-row sequences (idx [n, L, T, k])."""
        n, L, T = idx.shape[:3]
        read = self._bytes_read() - bytes0
        k = self.counters
        k.steps += n
        k.rows += n * T
        k.decode_rows += n * T
        k.busy_s += seconds
        self.store.count_step(0, n * T, read)
        if L == 0:  # a dense model: no experts to count
            return
        # Distinct experts per (step, layer): over all rows (the union fetched) and per row (batching_counts).
        union = idx.reshape(n * L, -1).sort(-1).values
        unique = n * L + int((union[:, 1:] != union[:, :-1]).sum())
        rows = idx.reshape(n * L * T, -1).sort(-1).values
        own = (1 + (rows[:, 1:] != rows[:, :-1]).sum(-1)).view(n * L, T).sum(0)  # [T]
        k.experts_unique += unique
        k.experts_summed += int(own.sum())
        for c, mine in zip(chunks, own.tolist()):
            st = c.a.h.stats
            st.experts_own += mine
            st.experts_fetched_share += unique / T
            st.bytes_read_share += read / T

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float = 30.0) -> None:
        for h in self.sched.close():
            h._finish("cancelled", EngineClosedError("the engine was closed before this request started"))
        for a in list(self.sched.active):
            a.h.cancel()
        self.sched.wake()
        # Let the loop end the running requests at its next admit, then stop it.
        deadline = time.monotonic() + timeout
        while self.sched.active and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stop.set()
        self.sched.wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
