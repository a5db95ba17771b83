"""One request's tokens, from the engine thread to the event loop, as text pieces.

The engine thread calls the handle's listener per token; `loop.call_soon_threadsafe` moves each
event into an asyncio.Queue, and `Relay.pieces()` turns them into text: incremental UTF-8 decoding
(StreamDecoder), stop strings held back and cut (StopMatcher). Closing the generator early (client
gone) cancels the request, which frees its slot at the engine's next step; `until_disconnect` does
the same for a request whose whole answer is awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from ..engine.request import RequestHandle, TokenEvent
from ..tokenizer import StreamDecoder, Tokenizer
from .protocol import APIError
from .stops import StopMatcher

# engine finish reason -> OpenAI finish_reason ("ctx": the context is full, which OpenAI calls length)
FINISH = {"stop": "stop", "length": "length", "ctx": "length", "cancelled": "cancelled", "error": "error"}


@dataclass
class Piece:
    text: str
    events: list[TokenEvent] = field(default_factory=list)  # the tokens this text came from (logprobs)


class Relay:
    def __init__(self, tokenizer: Tokenizer, stops: list[str],
                 on_end: Callable[[Relay], None] | None = None, on_token_gap: Callable[[float], None] | None = None,
                 keep: frozenset[int] = frozenset()):
        # The handle is set right after Engine.submit(listener=self._on_event) returns, on the loop thread:
        # the listener is registered before the request is queued, so no event is missed.
        self.handle: RequestHandle = None  # type: ignore[assignment]
        self.tok = tokenizer
        self.keep = keep  # special tokens kept in the text: a chat format's markers (server/answer.py)
        self.matcher = StopMatcher(stops)
        self.stop_hit = False
        self.on_end, self.on_token_gap = on_end, on_token_gap
        self.started = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()

    def _on_event(self, ev: TokenEvent | None) -> None:
        """On the engine thread: hand the event to the loop (must not raise)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
            if ev is None and self.on_end is not None:  # on the loop, where `handle` is surely set
                self.loop.call_soon_threadsafe(self.on_end, self)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stop_hit else FINISH.get(self.handle.finish_reason or "", "cancelled")

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces until the request ends: one per token with text, an empty one per token without any
        (a part of a character waits for the rest instead); a stop string ends it early (and is never sent)."""
        dec = StreamDecoder(self.tok, self.keep)
        pending: list[TokenEvent] = []
        last = None
        try:
            while (ev := await self.queue.get()) is not None:
                now = time.perf_counter()
                if last is not None and self.on_token_gap is not None:
                    self.on_token_gap(now - last)
                last = now
                if self.stop_hit:
                    continue  # cancelled: the engine may still deliver one more token
                pending.append(ev)
                text, self.stop_hit = self.matcher.push(dec.push(ev.token))
                if self.stop_hit:
                    self.handle.cancel()
                    if text:
                        yield Piece(text, pending[:-1])  # the token that completed the stop string is not sent
                    pending = []
                elif text:
                    yield Piece(text, pending)
                    pending = []
                elif not dec.partial:  # a token with no text at all (not part of a character, whose
                    yield Piece("", [])  # text comes with the next one): an empty chunk says it was made
            if not self.stop_hit:
                text, self.stop_hit = self.matcher.push(dec.flush())
                text += self.matcher.flush()
                if text or pending:
                    yield Piece(text, pending)
        finally:
            if not self.handle.done:
                self.handle.cancel()

    async def text(self) -> tuple[str, list[TokenEvent]]:
        """The whole completion (non-streaming)."""
        parts, events = [], []
        async for p in self.pieces():
            parts.append(p.text)
            events.extend(p.events)
        return "".join(parts), events


async def until_disconnect(request: Request, work):
    """Await `work`, cancelling it (and so the request: its slot is freed) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # (it ends at the loop's next turn: not done yet)
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection", "client_closed")
    return task.result()
