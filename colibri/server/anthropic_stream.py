"""A streamed Anthropic Messages answer, event by event as Anthropic's API sends them: `message_start`, a
`ping`, then per content block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`.
A `ping` also goes out whenever nothing else did for PING_S seconds (a long prompt prefilling), so clients and
proxies do not time out. The text is split as the whole answer's is (server/answer.py, tool_stream.py), so
the stream adds up to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from .anthropic_answer import engine_error, message, stop_reason, usage
from .error_shapes import ANTHROPIC_TYPES, anthropic_status
from .relay import Piece, Relay

PING_S = 5.0


def event(kind: str, **fields) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}


PING = {"event": "ping", "data": '{"type": "ping"}'}


class _Blocks:
    """The content blocks as they open, fill and close, one at a time."""

    def __init__(self):
        self.index, self.open = -1, None  # the current block's index and type

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]

    def _start(self, block: dict) -> list[dict]:
        out = self.close()
        self.index, self.open = self.index + 1, block["type"]
        return out + [event("content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict) -> dict:
        return event("content_block_delta", index=self.index, delta=delta)

    def thinking(self, text: str) -> list[dict]:
        if not text:
            return []
        out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        return out + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[dict]:
        if not text:
            return []
        out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": text})]

    def call(self, call_id: str, name: str, arguments: str = "") -> list[dict]:
        return self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}}) + self.arguments(arguments)

    def arguments(self, text: str) -> list[dict]:
        return [self._delta({"type": "input_json_delta", "partial_json": text})] if text and self.open else []


async def with_pings(pieces: AsyncIterator[Piece], every: float) -> AsyncIterator[Piece | None]:
    """The pieces, and None whenever `every` seconds pass without one. Closing this closes `pieces` (which
    cancels the request: its slot is freed)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for p in pieces:
                await queue.put(p)
        finally:
            queue.put_nowait(StopAsyncIteration)

    task = asyncio.ensure_future(pump())
    get: asyncio.Future | None = None
    try:
        while True:
            get = get or asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get}, timeout=every)
            if not done:
                yield None
                continue
            item, get = get.result(), None
            if item is StopAsyncIteration:
                return
            yield item
    finally:
        if get is not None:
            get.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def events(mid: str, model: str, n_prompt: int, relay: Relay, split, every: float = PING_S):
    """The SSE events of one answer. split: its splitter (server/answer.py, or tool_stream.py's for a forced
    call, whose deltas `take()` hands out as they are written)."""
    start_usage = {"input_tokens": n_prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                   "output_tokens": 0}
    yield event("message_start", message=message(mid, model, [], None, None, start_usage))
    yield PING
    b = _Blocks()
    take = getattr(split, "take", None)
    async for p in with_pings(relay.pieces(), every):
        if p is None:
            yield PING
            continue
        reasoning, text = split.push(p.text)
        for e in b.thinking(reasoning) + b.text(text):
            yield e
        for d in take() if take is not None else []:
            fn = d["function"]
            for e in b.call(d["id"], fn["name"], fn.get("arguments", "")) if "name" in fn else \
                    b.arguments(fn.get("arguments", "")):
                yield e
    if (err := engine_error(relay)) is not None:  # (Anthropic's error event ends the stream)
        status = anthropic_status(err)
        yield event("error", error={"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": err.message})
        return
    reasoning, rest, made = split.finish()
    out = b.thinking(reasoning) + b.text(rest or "")
    if not getattr(split, "sent_calls", False):  # a forced call streamed its deltas already
        for c in made:
            out += b.call(c["id"], c["function"]["name"], c["function"]["arguments"])
    for e in out + b.close():
        yield e
    stop, seq = stop_reason(relay, made)
    yield event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq}, usage=usage(relay, n_prompt))
    yield event("message_stop")
