"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/version), for the clients that
speak it: each request becomes a chat or text completion of the OpenAI routes, and the answer (or
its stream) comes back as Ollama's JSON (or newline-delimited JSON, the default: `"stream": true`).

Ollama's sampling defaults apply where `options` leave a value unset (temperature 0.8, top_k 40,
top_p 0.9, repeat_penalty 1.1 over the last repeat_last_n = 64 tokens); `num_predict` -1 / -2 mean up
to the context; `format` "json" or a JSON schema constrains the answer. docs/SERVER.md lists what is
supported.
"""

from __future__ import annotations

import functools
import json
import os
import time
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .protocol import APIError, ChatCompletionRequest, CompletionRequest, _Strict, bad_request, parse, parse_arguments
from .responses import chunk_dicts, merge_tool_deltas

router = APIRouter()
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 64}


class Options(_Strict):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None  # -1: the whole context, 0: no penalty
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class _Base(_Strict):
    model: str | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: str | int | float | None = None  # (accepted: the one model stays loaded)


class ChatBody(_Base):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Base):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    suffix: str | None = None


def _sampling(o: Options | None, fmt) -> dict:
    o = o or Options()
    out: dict[str, Any] = {k: getattr(o, k) if getattr(o, k) is not None else v for k, v in DEFAULTS.items()}
    for k in ("min_p", "seed", "presence_penalty", "frequency_penalty"):
        if getattr(o, k) is not None:
            out[k] = getattr(o, k)
    if o.num_predict is not None and o.num_predict > 0:
        out["max_tokens"] = o.num_predict
    if o.stop:
        out["stop"] = o.stop[:4]
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("format must be \"json\" or a JSON schema", "format")
    return out


def _think(think: bool | str | None) -> dict:
    """Ollama's `think` as chat-template variables: on / off under the names the templates of thinking
    models read (Qwen3 and GLM `enable_thinking`, DeepSeek-V3.1 `thinking`), a level as gpt-oss's
    `reasoning_effort`; unset leaves the template's default. The thinking the model writes comes back
    apart from the answer either way (`thinking`)."""
    if think is None:
        return {}
    if isinstance(think, str):
        return {"chat_template_kwargs": {"reasoning_effort": think}}
    return {"chat_template_kwargs": {"enable_thinking": think, "thinking": think}}


def _message(m: dict, n: int) -> dict:
    if m.get("images"):
        raise bad_request(f"messages[{n}]: images are not supported (text models)", "messages")
    out = {k: m[k] for k in ("role", "content") if k in m}
    calls = m.get("tool_calls")
    if calls and (not isinstance(calls, list) or not all(isinstance(tc, dict) for tc in calls)):
        raise bad_request(f"messages[{n}]: tool_calls must be a list of objects", "messages")
    if calls:  # Ollama's calls carry arguments as objects and no ids
        out["tool_calls"] = [{"id": f"call_{n}_{k}", "type": "function", "function": tc.get("function", {})}
                             for k, tc in enumerate(m["tool_calls"])]
    return out


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _stats(timings: dict | None, usage: dict | None, t0: float) -> dict:
    """Ollama's counters (nanoseconds) from the OpenAI answer's usage and llama-server-style timings."""
    t, u = timings or {}, usage or {}
    return {"total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
            "prompt_eval_count": u.get("prompt_tokens", 0), "prompt_eval_duration": int(t.get("prompt_ms", 0) * 1e6),
            "eval_count": u.get("completion_tokens", 0), "eval_duration": int(t.get("predicted_ms", 0) * 1e6)}


def _done_reason(finish: str | None) -> str:
    return "length" if finish in ("length", "ctx") else "stop"


def _calls(tool_calls: list | None) -> list[dict]:
    return [{"function": {"name": tc["function"]["name"], "arguments": parse_arguments(tc["function"]["arguments"])}}
            for tc in tool_calls or []]


async def _ndjson(state, chunks, t0: float, chat: bool):
    """Ollama's stream lines from the OpenAI stream's chunks (one choice)."""
    finish, usage, timings = None, None, None
    calls: dict[int, dict] = {}  # the tool calls so far, by index
    async for c in chunk_dicts(chunks):
        if "error" in c:
            yield json.dumps({"error": c["error"].get("message")}) + "\n"
            return
        if c.get("usage"):
            usage, timings = c["usage"], c.get("timings")
        for ch in c.get("choices") or []:
            finish = ch.get("finish_reason") or finish
            if chat:
                d = ch["delta"]
                msg: dict[str, Any] = {"role": "assistant", "content": d.get("content") or ""}
                if d.get("reasoning_content"):
                    msg["thinking"] = d["reasoning_content"]
                merge_tool_deltas(calls, d.get("tool_calls") or [])
                if ch.get("finish_reason") and calls:  # (Ollama sends whole calls: their arguments as objects)
                    msg["tool_calls"] = _calls([calls[k] for k in sorted(calls)])
                if msg["content"] or len(msg) > 2:
                    yield json.dumps({"model": state.model_id, "created_at": _now(), "message": msg,
                                      "done": False}, ensure_ascii=False) + "\n"
            elif ch.get("text"):
                yield json.dumps({"model": state.model_id, "created_at": _now(), "response": ch["text"],
                                  "done": False}, ensure_ascii=False) + "\n"
    last: dict[str, Any] = {"model": state.model_id, "created_at": _now(), "done": True,
                            "done_reason": _done_reason(finish), **_stats(timings, usage, t0)}
    last.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    yield json.dumps(last) + "\n"


def _ollama_errors(fn):
    """Errors in Ollama's shape, `{"error": "text"}` (its clients raise with that text), same statuses."""
    @functools.wraps(fn)
    async def wrapped(request: Request):
        try:
            return await fn(request)
        except APIError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
    return wrapped


@router.post("/api/chat")
@_ollama_errors
async def api_chat(request: Request):
    state, t0 = request.app.state.colibri, time.perf_counter()
    body: ChatBody = parse(ChatBody, await request.body())
    oai = {"model": None, "messages": [_message(m, n) for n, m in enumerate(body.messages)], "stream": body.stream,
           **_sampling(body.options, body.format), **_think(body.think)}
    if body.tools:
        oai["tools"] = body.tools
    if body.stream:
        oai["stream_options"] = {"include_usage": True}
    state.check_model(_model(body.model, state))
    out = await request.app.state.chat(state, parse(ChatCompletionRequest, json.dumps(oai).encode()), request)
    if not isinstance(out, dict):
        return StreamingResponse(_ndjson(state, out, t0, True), media_type="application/x-ndjson")
    c = out["choices"][0]
    msg: dict[str, Any] = {"role": "assistant", "content": c["message"]["content"] or ""}
    if c["message"].get("reasoning_content"):
        msg["thinking"] = c["message"]["reasoning_content"]
    if c["message"].get("tool_calls"):
        msg["tool_calls"] = _calls(c["message"]["tool_calls"])
    return {"model": state.model_id, "created_at": _now(), "message": msg, "done": True,
            "done_reason": _done_reason(c["finish_reason"]), **_stats(out.get("timings"), out["usage"], t0)}


@router.post("/api/generate")
@_ollama_errors
async def api_generate(request: Request):
    state, t0 = request.app.state.colibri, time.perf_counter()
    body: GenerateBody = parse(GenerateBody, await request.body())
    state.check_model(_model(body.model, state))
    if body.images:
        raise bad_request("images are not supported (text models)", "images")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix", "unsupported_parameter")
    if not body.prompt:  # Ollama: an empty prompt only loads the model
        return {"model": state.model_id, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
    sampling = _sampling(body.options, body.format)
    if not body.raw:  # the chat template, as Ollama applies it (system + prompt as one user turn)
        msgs = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt}]
        oai = {"messages": msgs, "stream": body.stream, **sampling, **_think(body.think)}
        if body.stream:
            oai["stream_options"] = {"include_usage": True}
        out = await request.app.state.chat(state, parse(ChatCompletionRequest, json.dumps(oai).encode()), request)
        if not isinstance(out, dict):
            return StreamingResponse(_generate_lines(_ndjson(state, out, t0, True)), media_type="application/x-ndjson")
        c = out["choices"][0]
        text = c["message"]["content"] or ""
        thinking = c["message"].get("reasoning_content")
    else:
        if "response_format" in sampling:
            raise bad_request("format needs the chat template: not with raw", "format")
        oai = {"prompt": body.prompt, "stream": body.stream, **sampling}
        # (a prompt longer than the context: 0 here, and the context check says so)
        oai.setdefault("max_tokens", max(state.engine.ctx_size - len(state.tok.encode(body.prompt)), 0))
        if body.stream:
            oai["stream_options"] = {"include_usage": True}
        out = await request.app.state.complete(state, parse(CompletionRequest, json.dumps(oai).encode()), request)
        if not isinstance(out, dict):
            return StreamingResponse(_ndjson(state, out, t0, False), media_type="application/x-ndjson")
        c = out["choices"][0]
        text, thinking = c["text"], None
    return {"model": state.model_id, "created_at": _now(), "response": text,
            **({"thinking": thinking} if thinking else {}), "done": True,
            "done_reason": _done_reason(c["finish_reason"]), **_stats(out.get("timings"), out["usage"], t0)}


async def _generate_lines(chat_lines):
    """/api/generate's lines from /api/chat's: the message's content becomes `response`, its thinking
    `thinking`."""
    async for line in chat_lines:
        obj = json.loads(line)
        if "message" in obj:
            msg = obj.pop("message")
            obj["response"] = msg.get("content", "")
            if msg.get("thinking"):
                obj["thinking"] = msg["thinking"]
        yield json.dumps(obj, ensure_ascii=False) + "\n"


def _model(name: str | None, state) -> str | None:
    """Ollama names carry a tag (`name:latest`): the served model answers to its id with or without it."""
    if name is None or name == state.model_id or name == f"{state.model_id}:latest":
        return None
    return name


@router.get("/api/tags")
async def api_tags(request: Request) -> dict:
    state = request.app.state.colibri
    return {"models": [_card(state)]}


@router.get("/api/ps")
async def api_ps(request: Request) -> dict:
    state = request.app.state.colibri
    return {"models": [{**_card(state), "expires_at": None, "size_vram": 0}]}


@router.post("/api/show")
@_ollama_errors
async def api_show(request: Request) -> dict:
    state = request.app.state.colibri
    e = state.engine
    return {"modelfile": "", "parameters": "", "template": e.tokenizer.chat_template
            if isinstance(e.tokenizer.chat_template, str) else "",
            "details": _card(state)["details"],
            "model_info": {"general.architecture": e.container.model_type, "colibri.context_length": e.ctx_size,
                           "colibri.n_layers": e.n_layers, "colibri.scheme": e.scheme},
            "capabilities": ["completion", "tools", *(["thinking"] if _thinks(e.tokenizer.chat_template) else [])]}


def _thinks(template) -> bool:
    """Whether the chat template shows a thinking model (a think tag, or a variable that switches it)."""
    text = template if isinstance(template, str) else json.dumps(template or "")
    return any(m in text for m in ("<think>", "enable_thinking", "reasoning_content", "reasoning_effort"))


@router.get("/api/version")
async def api_version() -> dict:
    from .. import __version__

    return {"version": __version__}


def _card(state) -> dict:
    e = state.engine
    return {"name": f"{state.model_id}:latest", "model": f"{state.model_id}:latest",
            "modified_at": datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z"),
            "size": os.path.getsize(e.container.path), "digest": "",
            "details": {"format": "coli", "family": e.container.model_type, "families": [e.container.model_type],
                        "parameter_size": "", "quantization_level": e.scheme}}
