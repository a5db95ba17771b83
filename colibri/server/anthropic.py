"""Anthropic's Messages API: POST /v1/messages (streamed or not) and /v1/messages/count_tokens, for the
clients that speak it (Claude Code, the Anthropic SDKs, agent frameworks built on them).

A request is rendered by the chat path's template, tool plan and reasoning split (server/chat_prompt.py),
so an answer is what /v1/chat/completions would give: thinking blocks from the model's reasoning, tool_use
blocks from the calls the model writes in its family's format (or a grammar-forced call for tool_choice
any / tool). `max_tokens` is clamped to the room the context leaves (agents send 32000 or 64000 whatever
the model). Errors come in Anthropic's shape (server/error_shapes.py). docs/SERVER.md lists every field.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from .answer import whole
from .anthropic_answer import blocks, engine_error, message, stop_reason, usage
from .anthropic_request import MessagesRequest, PromptRequest
from .anthropic_stream import events
from .chat_prompt import ChatPrompt, chat_prompt
from .protocol import APIError, bad_request, parse
from .relay import until_disconnect

router = APIRouter()
MAX_BODY = 32 * 1024 * 1024  # Anthropic's limit for a Messages request: beyond it, its 413


async def _body(request: Request) -> bytes:
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY:
        raise APIError(413, f"the request is larger than {MAX_BODY >> 20} MiB", "request_too_large")
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"the request is larger than {MAX_BODY >> 20} MiB", "request_too_large")
    return raw


def _prompt(state, req: PromptRequest) -> ChatPrompt:
    # Clients that name Anthropic's models (Claude Code asks for its default, claude-...) get the one served.
    if req.model is not None and not req.model.startswith("claude-"):
        state.check_model(req.model)
    messages, prefill = req.template_messages()
    return chat_prompt(state, messages, req.plan(), req.template_kwargs(), prefill)


@router.post("/v1/messages")
async def create_message(request: Request):
    state = request.app.state.colibri
    req: MessagesRequest = parse(MessagesRequest, await _body(request))
    prompt = _prompt(state, req)
    n, ctx = len(prompt.ids), state.engine.ctx_size
    if n >= ctx:
        raise bad_request(f"prompt is too long: {n} tokens > {ctx - 1} maximum (--ctx-size {ctx})", "messages",
                          "context_length_exceeded")
    max_new = min(req.max_tokens, ctx - n)  # (agents ask for more than a local context holds)
    kw, fmt = req.sampling_kw(), req.constraint()
    if fmt is not None and prompt.forced is not None:
        raise bad_request("output_config.format cannot go with tool_choice 'any' or 'tool'", "tool_choice")
    kw["grammar"] = prompt.forced or fmt
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    split = prompt.splitter(state, state.reasoning and kw["grammar"] is None)  # (a JSON grammar writes no <think>)
    relay = state.submit("messages", prompt.ids, max_new, req.stop_sequences or [], stop_ids=state.template.stop_ids,
                         request_id=mid, **kw)
    if req.stream:
        return EventSourceResponse(events(mid, state.model_id, n, relay, split()), sep="\n", ping=0)
    text, _ = await until_disconnect(request, relay.text())
    if (err := engine_error(relay)) is not None:
        raise err
    if prompt.forced is not None:  # the call's JSON (an answer cut short stays text)
        calls = whole(split(), text)[2]
        reasoning, content = "", None if calls else text
    else:
        reasoning, content, calls = whole(split(), text)
    stop, seq = stop_reason(relay, calls)
    return message(mid, state.model_id, blocks(reasoning, content, calls), stop, seq, usage(relay, n))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    state = request.app.state.colibri
    req: PromptRequest = parse(PromptRequest, await _body(request))
    return {"input_tokens": len(_prompt(state, req).ids)}
