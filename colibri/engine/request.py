"""A request to the engine and the handle its caller holds.

A request is prompt ids + sampling settings (with its own seeded generator) + stop
conditions. The engine thread fills the handle with `TokenEvent`s; the caller reads them
from any thread (`for ev in handle`), or registers a listener (what the server uses to
bridge into asyncio). Cancelling frees the request's slot at the next step.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ..errors import ColibriError

FINISH_REASONS = ("stop", "length", "ctx", "cancelled", "error")


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked. temperature 0 is greedy (top_k/top_p then do nothing).

    Penalties act as logits processors over the prompt and generated tokens: `repeat_penalty`
    (CTRL/transformers style, 1.0 = off) over the last `repeat_last_n` tokens of prompt + generated
    text (llama.cpp's and Ollama's window: 64 in their APIs here; -1 = all of them, transformers' rule
    and this default; 0 = none), `presence_penalty` and `frequency_penalty` over the generated tokens
    (OpenAI style, 0 = off). `logit_bias`: {token id: bias in [-100, 100]} added to the logits
    before anything else (OpenAI's rule; -100 bans a token, +100 all but forces it). `grammar`: the
    text must stay inside it (structured output, engine/grammar.py). `logprobs`:
    None = none; n >= 0 = the chosen token's log-probability plus the n most likely alternatives
    (of the model's distribution before sampling settings)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0
    repeat_last_n: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    grammar: str | None = None  # structured output (engine/grammar.py: json_grammar, regex_grammar, ...)

    def validate(self) -> SamplingParams:
        def finite(name: str, v: float) -> None:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ColibriError(f"{name} must be a finite number, got {v!r}")

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ColibriError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ColibriError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ColibriError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ColibriError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.repeat_penalty <= 0:
            raise ColibriError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or self.repeat_last_n < -1:
            raise ColibriError(f"repeat_last_n must be an integer >= -1, got {self.repeat_last_n!r}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ColibriError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ColibriError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ColibriError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise ColibriError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
                finite(f"logit_bias[{tok}]", bias)
                if not -100 <= bias <= 100:
                    raise ColibriError(f"logit_bias[{tok}] must be in [-100, 100], got {bias}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ColibriError(f"grammar must be a string (colibri.engine.grammar), got {type(self.grammar).__name__}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise ColibriError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        return self


@dataclass
class TokenEvent:
    """One generated token; `logprob`/`top` only when the request asked for logprobs."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # [(token id, logprob)], most likely first


@dataclass
class RequestStats:
    """What one request cost; the engine fills it as the request runs."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # leading prompt tokens whose K/V the slot already held (not computed)
    generated: int = 0
    queued_s: float = 0.0  # submit -> slot
    prefill_s: float = 0.0  # slot -> first token
    ttft_s: float = 0.0  # submit -> first token
    decode_s: float = 0.0  # first token -> last token
    finish_reason: str = ""
    # MoE batching: per (step, MoE layer), the experts this request routed to on its own (summed)
    # and its share of what the batch fetched (the union, divided among the requests of the step).
    experts_own: int = 0
    experts_fetched_share: float = 0.0
    bytes_read_share: float = 0.0
    # Speculative decoding (engine/speculative.py): drafts verified, those accepted, decode forwards run
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    # by draft position i (0 first): verifies whose drafts reached position i, and those whose draft i was kept
    draft_reached: list[int] = field(default_factory=list)
    draft_kept: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tps(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of the prefill; decode speed counts the ones after it.
        n = max(self.generated - 1, 0)
        return n / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per decode forward: 1 without drafts, 1 + accepted drafts per forward with them."""
        return 1.0 + self.accepted / self.forwards if self.forwards else 1.0

    # the name the CLI's stats line and `colibri bench` read
    @property
    def stop_reason(self) -> str:
        return self.finish_reason


_ids = itertools.count(1)
_END = object()


class RequestHandle:
    """The caller's side of a request. Iterate for `TokenEvent`s (blocks until each arrives; raises
    the request's error, if any, at the end); `cancel()` from any thread."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, *,
                 stop_ids: frozenset[int] = frozenset(), ignore_eos: bool = False,
                 prompt_logprobs: int | None = None, want_logits: bool = False, request_id: str | None = None,
                 constraint=None, speculative: str = "auto", draft_max: int = 8):
        self.id = request_id or f"req-{next(_ids)}"
        # engine/speculative.py: "auto" (drafts where the gate says they pay), "lookup" (every match), "off"
        self.speculative, self.draft_max = speculative, draft_max
        self.constraint = constraint  # the grammar's state (engine/grammar.py Constraint), or None
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.ignore_eos = ignore_eos
        self.prompt_logprobs = prompt_logprobs  # None, or n >= 0: log-probs of the prompt's own tokens (+ top n)
        self.want_logits = want_logits  # keep the prompt's full logits [T, V] (Engine.logits)
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        # Prompt scoring results (filled before the first token): entry i is about prompt token i
        # (None for the first, which has no context).
        self.prompt_token_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.logits = None  # torch.Tensor [T, V] f32 with want_logits
        self.tokens: list[int] = []  # generated so far
        self.submitted_at = time.perf_counter()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: list[Callable[[TokenEvent | None], None]] = []
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._done = threading.Event()

    # ------------------------------------------------------------------ caller side

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            item = self._q.get()
            if item is _END:
                self._q.put(_END)  # a second iteration ends at once
                if self.error is not None:
                    raise self.error
                return
            yield item

    def token_ids(self) -> Iterator[int]:
        for ev in self:
            yield ev.token

    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[int]:
        """Block until the request ends; its generated ids (raises its error, if any)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout}s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    def add_listener(self, fn: Callable[[TokenEvent | None], None]) -> None:
        """Call `fn(event)` on the engine thread for every later event, and `fn(None)` once at the
        end (also at once if the request already ended). `fn` must be quick and must not raise.
        To see every event, pass the listener to `Engine.submit(listener=...)` instead."""
        with self._lock:
            if not self._done.is_set():
                self._listeners.append(fn)
                return
        fn(None)

    # ------------------------------------------------------------------ engine side

    def _emit(self, ev: TokenEvent) -> None:
        self.tokens.append(ev.token)
        self._q.put(ev)
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(ev)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.finish_reason = reason
            self.stats.finish_reason = reason
            self.error = error
            self._q.put(_END)
            self._done.set()
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn(None)


class QueueFullError(ColibriError):
    """The engine's request queue is at its bound (the server answers 429)."""


class EngineClosedError(ColibriError):
    """The engine was closed (or is shutting down)."""
