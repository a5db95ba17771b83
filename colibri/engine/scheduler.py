"""Continuous batching: a bounded FIFO queue, N slots, and which rows each step runs.

A step runs one decode row for every request that is generating, plus prefill chunks of the
requests still reading their prompt, up to `prefill_chunk` prompt tokens per step in all (FIFO).
Prefill and decode share a step rather than alternate: a long prompt then stalls the running
streams by at most one chunk's time, and the prompt's rows and the decode rows meet in the same
expert union of every MoE layer (one fetch serves both). A request leaves at EOS / max_tokens /
context full / cancellation, and its slot goes to the next queued request in the same step.

Only the engine thread touches `Active` state; `submit` and `cancel` come from any thread and
meet the engine thread under `cond`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kv import SlotPool, common_prefix
from .request import EngineClosedError, QueueFullError, RequestHandle
from .sampling import TokenPicker


@dataclass
class Active:
    """A request holding a slot."""

    h: RequestHandle
    slot: int
    picker: TokenPicker
    fed: int = 0  # tokens written to the slot's cache (prompt, then generated)
    next_token: int | None = None  # sampled, not yet fed
    logits_parts: list[torch.Tensor] = field(default_factory=list)  # want_logits: prompt logits so far
    first_at: float = 0.0
    final: bool = False  # done generating; its last token is fed once more only so listeners see its routing
    native_prefill: bool = False  # its prompt is short enough for the native-sized steps throughout
    spec: object = None  # engine/speculative.py RequestSpec at its first decode step; False: it does not speculate

    @property
    def prompt_len(self) -> int:
        return len(self.h.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt_len


@dataclass
class Chunk:
    """One request's rows in a step: `tokens` at positions start..; `sample`: its last row is sampled;
    `all_rows`: every row's logits are kept (prompt scoring, a verify); `drafts`: the tokens after the first
    are drafts to verify (engine/speculative.py)."""

    a: Active
    tokens: list[int]
    start: int
    sample: bool
    all_rows: bool
    drafts: int = 0


class Scheduler:
    def __init__(self, slots: SlotPool, max_queue: int, prefill_chunk: int, mixed_rows: int | None = None,
                 cache_prompt: bool = True):
        """`cache_prompt`: a request starts from the longest prefix of its prompt that a free slot's
        cache holds (engine/kv.py). `mixed_rows`: while sequences are decoding, a step holds at most
        this many rows in all (the native kernels' row limit: such a step stays on them, and the
        running streams wait one short step rather than a long prefill). Prompts alone go
        `mixed_rows` at a time too when each had at most `native_prompt` (8 x mixed_rows) rows to
        compute, and at most twice that in all (cached ones included), and at most `native_prompt`
        are left in all, or once at most `short_prompt` (3 x mixed_rows) are left; otherwise up to
        `prefill_chunk` rows a step until one is left. None: no limit."""
        self.slots, self.max_queue, self.prefill_chunk = slots, max_queue, prefill_chunk
        # (request, slot) -> prompt positions it may take from the slot's cache (engine/mtp.py `cached`); None: all
        self.prefix_cap: Callable[[RequestHandle, int], int] | None = None
        self.mixed_rows = mixed_rows
        self.cache_prompt = cache_prompt
        # Measured (2 threads, AVX-512): a 128-token prompt in 64-row native steps took 0.55-0.75 of the
        # time of one torch-GEMM step on the 0.44b int8 model and 0.57 on the OLMoE-1B-7B-shaped int4 one.
        # The GEMMs grow more efficient with rows: on the AMD VM they won by 256-384 tokens; on the Intel
        # reference VM 64-row steps were 1.46-1.49x faster at 256 tokens, 1.30-1.35x at 384, 1.06-1.08x at
        # 512, and 0.80-0.88x at 1024-1536 tokens (0.44b int8 and int4, docs/ENGINE.md).
        self.short_prompt = 3 * mixed_rows if mixed_rows else 0
        self.native_prompt = 8 * mixed_rows if mixed_rows else 0
        self.queue: deque[RequestHandle] = deque()
        self.active: list[Active] = []  # admission order
        self.cond = threading.Condition()
        self.closed = False
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.cached_tokens = 0  # prompt tokens not computed: a slot's cache held them
        self.min_shared = 32  # a queued prompt waits for another's prefill when it would copy this many more

    # ------------------------------------------------------------------ any thread

    def submit(self, h: RequestHandle) -> None:
        with self.cond:
            if self.closed:
                raise EngineClosedError("the engine is closed")
            if len(self.queue) >= self.max_queue + self.slots.free:  # free slots take queued requests first
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self.queue.append(h)
            self.cond.notify()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def counts(self) -> dict:
        with self.cond:
            busy = self.slots.n_slots - self.slots.free
            return {"slots": self.slots.n_slots, "busy": busy, "free": self.slots.free,
                    "queued": len(self.queue), "max_queue": self.max_queue}

    # ------------------------------------------------------------------ engine thread

    def wait_for_work(self, timeout: float) -> bool:
        with self.cond:
            if not self.queue and not self.active and not self.closed:
                self.cond.wait(timeout)
            return bool(self.queue or self.active)

    def admit(self) -> None:
        """Drop cancelled requests (queued or running), then fill free slots from the queue."""
        with self.cond:
            for h in [h for h in self.queue if h.cancelled]:
                self.queue.remove(h)
                self.finished["cancelled"] = self.finished.get("cancelled", 0) + 1
                h._finish("cancelled")
            for a in [a for a in self.active if a.h.cancelled]:
                self.finish(a, "cancelled")
            waiting = 0  # requests waiting for a prefix keep their place: a slot each, before later ones
            for h in list(self.queue):
                if self.slots.free <= waiting:
                    break
                # Prompt scoring needs every prompt row's logits: it computes them all.
                reuse = self.cache_prompt and not h.want_logits and h.prompt_logprobs is None
                if reuse and self._awaits_prefix(h):
                    waiting += 1
                    continue
                self.queue.remove(h)
                slot, held = self.slots.acquire(h.prompt_ids if reuse else None)
                if self.prefix_cap is not None:  # (what else the request needs of the slot's positions)
                    held = min(held, self.prefix_cap(h, slot))
                h.stats.queued_s = time.perf_counter() - h.submitted_at
                # At least the last prompt row is computed: it gives the first token's logits.
                h.stats.cached_tokens = min(held, max(len(h.prompt_ids) - 1, 0))
                a = Active(h, slot, TokenPicker(h.sampling, h.prompt_ids, h.constraint), h.stats.cached_tokens)
                # The native steps' attention reads the context once per row, torch's once per step: deep in
                # a conversation (1500 positions) the GEMM steps were as fast or faster (0.77-1.03x).
                a.native_prefill = a.prompt_len - a.fed <= self.native_prompt and a.prompt_len <= 2 * self.native_prompt
                self.cached_tokens += a.fed
                self.active.append(a)

    def _awaits_prefix(self, h: RequestHandle) -> bool:
        """Whether `h` should wait for a request now prefilling a prompt that shares at least
        `min_shared` more of h's prompt than that request has computed: once computed, h copies those
        positions instead of computing them alongside (n choices of one prompt, or many conversations
        with one system prompt arriving together, prefill it once). Waiting costs h nothing: the two
        would share each step's prefill rows anyway. Requests behind h may go first into the slots
        beyond the one h keeps (admit), never into that one."""
        want = len(h.prompt_ids) - 1  # the last prompt row is always computed
        for a in self.active:
            if a.prefilling and min(common_prefix(a.h.prompt_ids, h.prompt_ids), want) - a.fed >= self.min_shared:
                return True
        return False

    def finish(self, a: Active, reason: str, error: BaseException | None = None) -> None:
        """End a request and free its slot at once (the next admit reuses it)."""
        if a in self.active:
            self.active.remove(a)
            self.slots.release(a.slot)
        self.finished[reason] = self.finished.get(reason, 0) + 1
        a.h._finish(reason, error)

    def plan(self) -> list[Chunk]:
        """This step's rows: decode rows first (one per generating request), then prompt chunks."""
        chunks = [Chunk(a, [a.next_token], a.fed, not a.final, False) for a in self.active if not a.prefilling]
        budget = self.prefill_chunk
        if chunks and self.mixed_rows is not None:
            budget = min(budget, max(self.mixed_rows - len(chunks), 1))
        elif self.mixed_rows is not None:
            prefilling = [a for a in self.active if a.prefilling]
            left = sum(a.prompt_len - a.fed for a in prefilling)
            if left <= self.short_prompt or (left <= self.native_prompt and all(a.native_prefill for a in prefilling)):
                budget = min(budget, self.mixed_rows)
            else:  # GEMM steps stop one row short: a prompt's last row always takes the native kernels, as
                # it does in a rerun that finds the rest cached (the same bits). Stopping 192 rows short
                # cost 6-13% at 1024-2048 tokens (native attention reads a long context once per row).
                budget = min(budget, max(left - 1, 1))
        for a in self.active:
            if not a.prefilling or budget <= 0:
                continue
            n = min(budget, a.prompt_len - a.fed)
            budget -= n
            last = a.fed + n == a.prompt_len
            scoring = a.h.prompt_logprobs is not None or a.h.want_logits
            chunks.append(Chunk(a, a.h.prompt_ids[a.fed : a.fed + n], a.fed, last and a.h.max_tokens > 0,
                                scoring))
        return chunks

    def close(self) -> list[RequestHandle]:
        """Refuse new requests; hand back the queued ones (the caller ends them)."""
        with self.cond:
            self.closed = True
            queued = list(self.queue)
            self.queue.clear()
            self.cond.notify_all()
            return queued
