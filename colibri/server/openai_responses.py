"""POST /v1/responses: OpenAI's Responses API, as a translation of the request into a chat completion
and of the answer (or its stream of chunks) back into a Response (or its stream of events).

Supported: `input` (a string, or items: messages with text parts, `function_call` and
`function_call_output`), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`,
`text.format` (text, json_object, json_schema), function `tools`, `tool_choice`,
`parallel_tool_calls` (and colibri's sampling extensions: seed, top_k, min_p), `store` (the default)
with `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` (server/response_store.py).
docs/SERVER.md.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field
from sse_starlette.sse import EventSourceResponse

from .protocol import APIError, ChatCompletionRequest, _Strict, bad_request, parse
from .response_store import ResponseStore, output_messages
from .responses import chunk_dicts, merge_tool_deltas

router = APIRouter()


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                         and p.get("type") in ("input_text", "output_text", "text") for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"{where}: content must be a string or a list of input_text parts (text only)", "input")


def _messages(req: ResponsesRequest) -> list[dict]:
    """The chat messages of `input` (without `instructions`: they are not stored with the conversation)."""
    out: list[dict] = []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for n, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "message":
            if it.get("role") not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{n}]: role must be user, assistant, system or developer", "input")
            out.append({"role": it["role"], "content": _text(it.get("content"), f"input[{n}]")})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise bad_request(f"input[{n}]: a function_call needs name and call_id", "input")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": _text(it.get("output"),
                                                                                            f"input[{n}]")})
        else:
            raise bad_request(f"input[{n}]: items of type '{kind}' are not supported", "input")
    return out


def _input_items(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as OpenAI lists it back: items with ids, a message's content as parts."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    out = []
    for it in items:
        kind = it.get("type", "message")
        item = {**it, "type": kind}
        if kind == "message" and isinstance(it.get("content"), str):
            part = "output_text" if it.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": it["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
        item.setdefault("id", f"{prefix}_{uuid.uuid4().hex[:24]}")
        item.setdefault("status", "completed")
        out.append(item)
    return out


def _chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completion of the request; `history`: the messages the conversation had before `input`."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": system + history, "stream": req.stream}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.tools:
        if any(t.get("type") != "function" for t in req.tools):
            raise bad_request("only function tools are supported", "tools", "unsupported_parameter")
        body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                             "strict") if t.get(k) is not None}}
                         for t in req.tools]
    if isinstance(req.tool_choice, dict):
        if not isinstance(req.tool_choice.get("name"), str):
            raise bad_request("tool_choice: a function choice needs its name", "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    return body


class _Builder:
    """The Response object, item by item (output items, their ids, usage, status)."""

    def __init__(self, req: ResponsesRequest, model: str, store: ResponseStore, history: list[dict]):
        self.req, self.model = req, model
        self.store, self.history = store, history  # the conversation through this request's input
        self.input_items = _input_items(req)
        self.id, self.created = f"resp_{uuid.uuid4().hex[:24]}", int(time.time())
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.status, self.incomplete = "in_progress", None

    def item(self, kind: str, **fields) -> dict:
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}[kind]
        it = {"type": kind, "id": f"{prefix}_{uuid.uuid4().hex[:24]}", **fields}
        self.output.append(it)
        return it

    def finish(self, reason: str | None, chat_usage: dict | None) -> None:
        self.status = "incomplete" if reason in ("length", "ctx") else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        if chat_usage:
            self.usage = {"input_tokens": chat_usage["prompt_tokens"],
                          "input_tokens_details": chat_usage.get("prompt_tokens_details") or {"cached_tokens": 0},
                          "output_tokens": chat_usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": chat_usage["total_tokens"]}

    def body(self) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "model": self.model, "output": self.output, "usage": self.usage, "error": None,
                "incomplete_details": self.incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "tools": r.tools or [], "tool_choice": r.tool_choice or "auto",
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "text": r.text.model_dump(by_alias=True, exclude_none=True) if r.text else {"format": {"type": "text"}},
                "previous_response_id": r.previous_response_id, "store": r.store,
                "metadata": r.metadata or {}}

    def done(self) -> dict:
        """The finished body, stored when asked (`store`, the default)."""
        body = self.body()
        if self.req.store:
            self.store.put(self.id, body, self.history + output_messages(self.output), self.input_items)
        return body


def _from_chat(b: _Builder, chat: dict) -> dict:
    c = chat["choices"][0]
    msg = c["message"]
    if msg.get("reasoning_content"):
        b.item("reasoning", summary=[], content=[{"type": "reasoning_text", "text": msg["reasoning_content"]}])
    if msg.get("content"):
        b.item("message", status="completed", role="assistant",
               content=[{"type": "output_text", "text": msg["content"], "annotations": []}])
    for tc in msg.get("tool_calls") or []:
        b.item("function_call", call_id=tc["id"], name=tc["function"]["name"],
               arguments=tc["function"]["arguments"], status="completed")
    b.finish(c["finish_reason"], chat.get("usage"))
    return b.done()


async def _events(b: _Builder, chunks):
    """Responses stream events from the chat completion's SSE chunks."""
    seq = 0

    def ev(kind: str, **fields) -> dict:
        nonlocal seq
        seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq, **fields},
                                                  ensure_ascii=False)}

    yield ev("response.created", response=b.body())
    yield ev("response.in_progress", response=b.body())
    open_items: dict[str, dict] = {}  # "message" / "reasoning" -> the item being written
    texts: dict[str, list[str]] = {}
    calls: dict[int, dict] = {}  # tool calls by index, as their deltas come ...
    items: dict[int, dict] = {}  # ... and their output items
    finish = None

    def close(kind: str):
        it = open_items.pop(kind)
        text, n = "".join(texts.pop(kind)), b.output.index(it)
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            it.update(status="completed", content=[part])
            yield ev("response.output_text.done", item_id=it["id"], output_index=n, content_index=0, text=text)
            yield ev("response.content_part.done", item_id=it["id"], output_index=n, content_index=0, part=part)
        else:
            it["content"] = [{"type": "reasoning_text", "text": text}]
            yield ev("response.reasoning_text.done", item_id=it["id"], output_index=n, content_index=0, text=text)
        yield ev("response.output_item.done", output_index=n, item=it)

    async for chunk in chunk_dicts(chunks):
        if "error" in chunk:
            yield ev("error", code=chunk["error"].get("code"), message=chunk["error"].get("message"), param=None)
            return
        if chunk.get("usage"):
            b.finish(finish, chunk["usage"])
        if not chunk.get("choices"):
            continue
        c = chunk["choices"][0]
        d = c["delta"]
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if not d.get(key):
                continue
            if kind == "message" and "reasoning" in open_items:
                for e in close("reasoning"):
                    yield e
            if kind not in open_items:
                fields = ({"summary": [], "content": []} if kind == "reasoning"
                          else {"status": "in_progress", "role": "assistant", "content": []})
                open_items[kind], texts[kind] = b.item(kind, **fields), []
                n = len(b.output) - 1
                yield ev("response.output_item.added", output_index=n, item=open_items[kind])
                if kind == "message":
                    yield ev("response.content_part.added", item_id=open_items[kind]["id"], output_index=n,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            it, n = open_items[kind], b.output.index(open_items[kind])
            texts[kind].append(d[key])
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            yield ev(name, item_id=it["id"], output_index=n, content_index=0, delta=d[key])
        for tc in d.get("tool_calls") or []:  # a call's first delta names it; the rest are pieces of arguments
            if merge_tool_deltas(calls, [tc]):  # a new call: the text before it is done
                for kind in list(open_items):
                    for e in close(kind):
                        yield e
                items[tc["index"]] = it = b.item("function_call", call_id=tc["id"], name=tc["function"]["name"],
                                                 arguments="", status="in_progress")
                yield ev("response.output_item.added", output_index=len(b.output) - 1, item=dict(it))
            if args := tc["function"].get("arguments"):
                it = items[tc["index"]]
                yield ev("response.function_call_arguments.delta", item_id=it["id"], output_index=b.output.index(it),
                         delta=args)
        if c.get("finish_reason"):
            finish = c["finish_reason"]
    for kind in list(open_items):
        for e in close(kind):
            yield e
    for k, it in items.items():
        args, n = calls[k]["function"]["arguments"], b.output.index(it)
        yield ev("response.function_call_arguments.done", item_id=it["id"], output_index=n, arguments=args)
        it.update(arguments=args, status="completed")
        yield ev("response.output_item.done", output_index=n, item=it)
    b.finish(finish, None)  # (the status; the usage came in its own chunk)
    yield ev("response.incomplete" if b.status == "incomplete" else "response.completed", response=b.done())


@router.post("/v1/responses")
async def responses(request: Request):
    state = request.app.state.colibri
    req: ResponsesRequest = parse(ResponsesRequest, await request.body())
    store: ResponseStore = request.app.state.responses
    history = []
    if req.previous_response_id is not None:
        history = list(_stored(store, req.previous_response_id, "previous_response_id").messages)
    history += _messages(req)
    chat_req = parse(ChatCompletionRequest, json.dumps(_chat_body(req, history)).encode())
    out = await request.app.state.chat(state, chat_req, request)
    b = _Builder(req, state.model_id, store, history)
    if isinstance(out, dict):
        return _from_chat(b, out)
    return EventSourceResponse(_events(b, out), sep="\n", ping=15)


def _stored(store: ResponseStore, rid: str, param: str | None = None):
    if (hit := store.get(rid)) is None:
        raise APIError(404, f"no response with id '{rid}' is stored here (it was not stored, was deleted, or "
                            f"the oldest ones were dropped past {store.capacity})", "response_not_found", param)
    return hit


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, request: Request) -> dict:
    return _stored(request.app.state.responses, rid).body


@router.get("/v1/responses/{rid}/input_items")
async def input_items(rid: str, request: Request, limit: int = 20, order: str = "desc", after: str | None = None
                      ) -> dict:
    """The response's input items, newest first by default (OpenAI's list: limit 1-100, order, after)."""
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got '{order}'", "order")
    items = list(_stored(request.app.state.responses, rid).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise bad_request(f"after: no input item '{after}' in response '{rid}'", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/v1/responses/{rid}")
async def delete_response(rid: str, request: Request) -> dict:
    store = request.app.state.responses
    _stored(store, rid)
    store.delete(rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}
