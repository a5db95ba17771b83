"""Stored Responses (`store: true`, OpenAI's default): what `previous_response_id` continues, and what
`GET` / `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items` read and remove.

In memory and bounded: the oldest responses go first past `capacity` (a client continuing a long-gone
response gets a 404 naming it). Each keeps its Response body and the conversation so far as chat
messages (input and output, without the request's `instructions`, which OpenAI does not carry over).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Stored:
    body: dict  # the Response object as it was answered
    messages: list[dict]  # the conversation through this response's output
    input_items: list[dict]  # the request's own input, as items with ids (GET .../input_items)


class ResponseStore:
    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, body: dict, messages: list[dict], input_items: list[dict]) -> None:
        with self._lock:
            self._items[rid] = Stored(body, messages, input_items)
            self._items.move_to_end(rid)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None


def output_messages(output: list[dict]) -> list[dict]:
    """A Response's output items as the chat messages that continue the conversation (reasoning items are
    not sent back: chat templates drop earlier turns' reasoning)."""
    text = "".join(p.get("text", "") for it in output if it["type"] == "message" for p in it.get("content") or [])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    if not text and not calls:
        return []
    msg: dict = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]
