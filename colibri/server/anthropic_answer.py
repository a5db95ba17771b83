"""Anthropic's Messages answer: the message object, its content blocks (thinking, text, tool_use), its
stop_reason and usage, and the model cards of Anthropic's GET /v1/models; shared by the whole answer
(server/anthropic.py) and its stream (server/anthropic_stream.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from .protocol import APIError
from .relay import Relay


def tool_input(arguments: str) -> dict:
    """A parsed call's arguments (JSON text of an object, as the format parsers and the grammar write them)."""
    try:
        obj = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def blocks(reasoning: str, content: str | None, calls: list[dict]) -> list[dict]:
    """The content blocks of an answer: its reasoning, its text, its tool calls (ids as the model family's
    format makes them: its template reads them back)."""
    out: list[dict] = []
    if reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        out.append({"type": "text", "text": content})
    out += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
             "input": tool_input(c["function"]["arguments"])} for c in calls]
    return out


def stop_reason(r: Relay, calls: list) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): tool_use when the answer ended with calls, stop_sequence (and which)
    when one matched, max_tokens when max_tokens (or the context) cut it, else end_turn."""
    if calls and r.finish_reason == "stop":
        return "tool_use", None
    if r.stop_hit:
        return "stop_sequence", r.matcher.matched
    return ("max_tokens", None) if r.finish_reason == "length" else ("end_turn", None)


def usage(r: Relay, n_prompt: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens computed, cache_read_input_tokens those a slot's
    prompt cache held (their sum is the prompt)."""
    st = r.handle.stats
    return {"input_tokens": n_prompt - st.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": st.cached_tokens, "output_tokens": st.generated}


def engine_error(r: Relay) -> APIError | None:
    """Why a request did not end normally (the engine failed, or the server cancelled it at shutdown)."""
    if r.handle.finish_reason == "error":
        return APIError(500, f"the engine failed on this request: {r.handle.error}", "engine_error")
    if r.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down", "shutting_down")
    return None


def message(mid: str, model: str, content: list[dict], stop: str | None, seq: str | None, use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": seq, "usage": use}


def model_card(state) -> dict:
    created = datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": state.model_id, "display_name": state.model_id, "created_at": created}


def model_list(state) -> dict:
    card = model_card(state)
    return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
