"""The OpenAI-compatible HTTP server: FastAPI routes over `Engine.submit` (docs/SERVER.md).

One engine thread owns torch; handlers here only render prompts, submit requests and relay the
tokens (colibri/server/relay.py). Errors are OpenAI-shaped JSON, never a traceback. SIGINT/SIGTERM
drain: new requests get 503 while running ones finish (cancelled after a grace period), then the
engine is closed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.request import EngineClosedError, QueueFullError, RequestHandle
from ..errors import ColibriError
from .answer import keep_ids, whole
from .anthropic import router as anthropic_router
from .anthropic_answer import model_card as anthropic_model
from .anthropic_answer import model_list as anthropic_models
from .chat_prompt import chat_prompt
from .dashboard import router as dashboard_router
from .error_shapes import api_of, error_response
from .metrics import CONTENT_TYPE, Metrics
from .ollama import router as ollama_router
from .openai_responses import router as responses_router
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, parse
from .relay import Relay, until_disconnect
from .response_store import ResponseStore
from .responses import ChatBodies, CompletionBodies, TokenText, chat_logprobs, completion_logprobs, usage
from .slots import router as slots_router
from .tokens import router as tokens_router
from .tool_formats import detect
from .tools import plan as tool_plan
from .webui import router as webui_router

log = logging.getLogger("colibri.server")


class ServerState:
    """What the routes share: the engine, the model's id and template, requests in flight."""

    def __init__(self, engine, model_id: str, api_key: str | None = None, slot_dir: Path | None = None,
                 reasoning: bool = True, allowed_origins: list[str] | None = None, tool_parser: str | None = None):
        self.engine, self.model_id, self.api_key = engine, model_id, api_key
        self.allowed_origins = allowed_origins or []  # CORS: web pages of these origins may call the API
        self.reasoning = reasoning  # <think> ... </think> -> reasoning_content (server/reasoning.py)
        self.slot_dir = slot_dir  # --slot-save-path: where POST /slots/{id} saves and restores
        self.tok = engine.tokenizer
        self.text_of = TokenText(self.tok)
        self.metrics = Metrics(engine)
        self.inflight: set[RequestHandle] = set()
        self.draining = False
        self.created = int(time.time())
        try:
            self.template, self.template_error = self.tok.template(), None
        except ColibriError as e:  # the server still serves /v1/completions
            self.template, self.template_error = None, str(e)
            log.warning("colibri: /v1/chat/completions is unavailable: %s", e)
        # how the model writes tool calls (server/tool_formats.py), and the special tokens of that format
        # (and <think>) that chat answers keep in their decoded text for the parsers
        self.tool_format = tool_parser or detect(self.template.source if self.template is not None else "")
        # Hunyuan-A13B's answers come wrapped in <answer> ... </answer>: the content goes out without the tags
        self.answer_tags = self.template is not None and "<answer>" in self.template.source
        self.keep = keep_ids(self.tok, self.tool_format)

    # ------------------------------------------------------------------ request plumbing

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_id}'",
                           "model_not_found", "model")

    def fit(self, n_prompt: int, max_new: int | None, param: str) -> int:
        """max_tokens for a prompt of n_prompt tokens: the rest of the context when unset; 400 when
        prompt + max_tokens exceed the context (as OpenAI answers)."""
        ctx = self.engine.ctx_size
        if max_new is None:
            max_new = ctx - n_prompt
        if n_prompt + max_new > ctx or n_prompt >= ctx and max_new > 0:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens, but {n_prompt + max_new} "
                           f"were requested ({n_prompt} in the {param}, {max_new} in the completion)",
                           "context_length_exceeded", param)
        return max_new

    def submit(self, endpoint: str, ids: list[int], max_new: int, stops: list[str], **kw) -> Relay:
        if self.draining:
            raise APIError(503, "the server is shutting down", "shutting_down")
        relay = Relay(self.tok, stops, on_end=lambda r: self._ended(endpoint, r), on_token_gap=self.metrics.itl.observe,
                      keep=frozenset() if endpoint == "completions" else self.keep)
        try:
            h = self.engine.submit(ids, max_new, request_id=kw.pop("request_id"), listener=relay._on_event, **kw)
        except QueueFullError as e:
            raise APIError(429, str(e), "queue_full") from None
        except EngineClosedError:
            raise APIError(503, "the server is shutting down", "shutting_down") from None
        except ColibriError as e:
            raise bad_request(str(e)) from None
        relay.handle = h
        self.inflight.add(h)
        return relay

    def _ended(self, endpoint: str, r: Relay) -> None:
        """On the event loop when a request ends: its log line and metrics."""
        h, st = r.handle, r.handle.stats
        self.inflight.discard(h)
        ttft = st.ttft_s if st.generated else None
        self.metrics.finished(endpoint, r.finish_reason, st.prompt_tokens, st.generated, ttft,
                              time.perf_counter() - r.started, st.cached_tokens)
        spec = (f" (drafts {st.accepted}/{st.drafted} accepted, {st.tokens_per_forward:.2f} tok/forward)"
                if getattr(st, "drafted", 0) else "")
        log.info("%s %s: prompt %d tok (%d cached), completion %d tok, TTFT %s, %.1f tok/s%s, finish %s", h.id,
                 endpoint, st.prompt_tokens, st.cached_tokens, st.generated,
                 f"{ttft * 1000:.0f} ms" if ttft is not None else "-", st.decode_tps, spec, r.finish_reason)

    def cancel_all(self) -> None:
        for h in list(self.inflight):
            h.cancel()


# ---------------------------------------------------------------------------- the app


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="colibri", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.colibri = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        out = error_response(e, api_of(request.scope))
        state.metrics.errors.labels(str(out.status_code)).inc()
        return out

    @app.exception_handler(RequestValidationError)
    async def param_error(request: Request, e: RequestValidationError) -> JSONResponse:
        """A path or query parameter of the wrong type (`/slots/x`, `?limit=many`): a 400 naming it."""
        err = (e.errors() or [{}])[0]
        where = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return await api_error(request, bad_request(f"{where}: {err.get('msg', 'invalid')}", where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            err = APIError(404, f"unknown route {request.method} {request.url.path}", "unknown_url")
        elif e.status_code == 405:
            err = APIError(405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed")
        else:
            err = APIError(e.status_code, str(e.detail))
        return await api_error(request, err)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("colibri: internal error on %s %s", request.method, request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(e).__name__}", "internal_error"))

    app.add_middleware(_Gate, state=state)
    if state.allowed_origins:  # added last: outermost, so a preflight (no API key) is answered before the gate
        app.add_middleware(CORSMiddleware, allow_origins=state.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.include_router(dashboard_router)  # GET /dashboard, GET /v1/colibri/stats
    app.include_router(webui_router)  # GET /: the chat page
    app.include_router(tokens_router)  # POST /tokenize, POST /detokenize
    app.include_router(slots_router)  # GET /slots, POST /slots/{id}?action=save|restore|erase
    app.include_router(responses_router)  # POST /v1/responses (through chat, below)
    app.include_router(ollama_router)  # Ollama's /api/chat, /api/generate, /api/tags ... (through chat, complete)
    app.include_router(anthropic_router)  # Anthropic's POST /v1/messages, /v1/messages/count_tokens

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok", **state.engine.health()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "colibri",
                "max_model_len": state.engine.ctx_size}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        if api_of(request.scope) == "anthropic":  # Anthropic's SDKs list models in their own shape
            return anthropic_models(state)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        state.check_model(model_id)
        return anthropic_model(state) if api_of(request.scope) == "anthropic" else model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        out = await chat(state, parse(ChatCompletionRequest, await request.body()), request)
        return out if isinstance(out, dict) else _sse(out)

    app.state.chat = chat  # POST /v1/responses (server/openai_responses.py) answers through it
    app.state.responses = ResponseStore()  # ... and keeps what it answered (store: true)

    @app.post("/v1/completions")
    async def completions(request: Request):
        out = await complete(state, parse(CompletionRequest, await request.body()), request)
        return out if isinstance(out, dict) else _sse(out)

    app.state.complete = complete  # the Ollama routes (server/ollama.py) answer through these two

    return app


# ---------------------------------------------------------------------------- chat


async def chat(state: ServerState, req: ChatCompletionRequest, request: Request):
    """A chat completion: its body, or (stream) the generator of its SSE events."""
    state.check_model(req.model)
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    prompt = chat_prompt(state, [m.for_template() for m in req.messages], plan, req.chat_template_kwargs)
    ids, forced = prompt.ids, prompt.forced  # forced: required / named, the call's JSON
    if forced is not None and req.constraint() is not None:
        raise bad_request("a response_format, json_schema or grammar cannot go with tool_choice "
                          f"'{plan.mode}'", "tool_choice")
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    max_new = state.fit(len(ids), req.max_new, "messages")
    # Reasoning is split off unless JSON is asked for (a JSON grammar writes no <think>).
    split = prompt.splitter(state, state.reasoning and forced is None and not req.json_mode)

    def sampling(i: int) -> dict:
        kw = req.sampling_kw(i)
        if forced is not None:
            kw["grammar"] = forced
        return kw

    relays = _submit_all(req.n, lambda i: state.submit(
        "chat", ids, max_new, req.stop_strings(), stop_ids=() if req.ignore_eos else state.template.stop_ids,
        ignore_eos=req.ignore_eos, request_id=rid if req.n == 1 else f"{rid}-{i}",
        logprobs=(req.top_logprobs or 0) if req.logprobs else None, **sampling(i)))
    bodies = ChatBodies(rid, state.model_id)

    if req.stream:
        return _chat_stream(state, req, [ids], relays, bodies, split)
    results = await until_disconnect(request, asyncio.gather(*(r.text() for r in relays)))
    choices = []
    for i, (r, (text, events)) in enumerate(zip(relays, results)):
        _raise_engine_error(r)
        lp = chat_logprobs(events, state.text_of) if req.logprobs else None
        if forced is not None:  # a required / named call's JSON (an answer cut short stays text)
            calls = whole(split(), text)[2]
            reasoning, content = "", None if calls else text
        else:
            reasoning, content, calls = whole(split(), text)
        choices.append(ChatBodies.choice(i, content, _finish(r.finish_reason, calls), lp, calls, reasoning))
    return {**bodies.full(choices, _usage([ids], relays)), "timings": _timings(relays[0])}


async def complete(state: ServerState, req: CompletionRequest, request: Request):
    """A text completion: its body, or (stream) the generator of its SSE events."""
    state.check_model(req.model)
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    prompts = [(p, state.tok.encode(p) if isinstance(p, str) else p) for p in req.prompts()]
    for _, ids in prompts:
        state.fit(len(ids), req.max_tokens, "prompt")
    # Choice i * n + j: prompt i's j-th completion (OpenAI's order).
    each = [prompts[i // req.n] for i in range(len(prompts) * req.n)]
    relays = _submit_all(len(each), lambda i: state.submit(
        "completions", each[i][1], req.max_tokens, req.stop_strings(), ignore_eos=req.ignore_eos,
        request_id=rid if len(each) == 1 else f"{rid}-{i}", logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
        **req.sampling_kw(i % req.n)))
    bodies = CompletionBodies(rid, state.model_id)
    if req.stream:
        return _completion_stream(state, req, each, [ids for _, ids in prompts], relays, bodies)
    results = await until_disconnect(request, asyncio.gather(*(r.text() for r in relays)))
    choices = []
    for i, ((p, ids), r, (text, events)) in enumerate(zip(each, relays, results)):
        _raise_engine_error(r)
        head = _echo_text(state, p, ids) if req.echo else ""
        lp = _completion_lp(state, req, ids, r, events) if req.logprobs is not None else None
        choices.append(CompletionBodies.choice(i, head + text, r.finish_reason, lp))
    return {**bodies.full(choices, _usage([ids for _, ids in prompts], relays)), "timings": _timings(relays[0])}


# ---------------------------------------------------------------------------- helpers


_KEYED = ("/tokenize", "/detokenize", "/slots", "/api/")  # besides /v1/*: what an API key guards (/api: Ollama's)


class _Gate:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects from streams):
    the API key (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`) on /v1/* and the tokenizer
    routes, and 503 while shutting down; errors in the shape of the API asked (server/error_shapes.py)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", *_KEYED)):
            err = None
            if self.state.api_key is not None:
                headers = dict(scope["headers"])
                auth = headers.get(b"authorization", b"")
                key = self.state.api_key.encode()
                given = [auth[7:] if auth[:7].lower() == b"bearer " else b"", headers.get(b"x-api-key", b"")]
                if not any([hmac.compare_digest(g, key) for g in given]):  # (both compared: constant time)
                    err = APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or "
                                   "'x-api-key: KEY')", "invalid_api_key")
            if err is None and self.state.draining:
                err = APIError(503, "the server is shutting down", "shutting_down")
            if err is not None:
                out = error_response(err, api_of(scope))
                self.state.metrics.errors.labels(str(out.status_code)).inc()
                await out(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(gen) -> EventSourceResponse:
    return EventSourceResponse(gen, sep="\n", ping=15)


def _json(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False)}


def _raise_engine_error(r: Relay) -> None:
    if r.handle.finish_reason == "error":
        raise APIError(500, f"the engine failed on this request: {r.handle.error}", "engine_error")
    if r.finish_reason == "cancelled":
        raise APIError(503, "the request was cancelled: the server is shutting down", "shutting_down")


def _error_event(r: Relay) -> dict | None:
    """The stream's last word when the request did not end normally."""
    if r.handle.finish_reason == "error":
        return _json(APIError(500, f"the engine failed on this request: {r.handle.error}", "engine_error").body())
    if r.finish_reason == "cancelled":
        return _json(APIError(503, "the request was cancelled: the server is shutting down", "shutting_down").body())
    return None


async def _merged(relays: list[Relay]):
    """(choice index, piece) as each request's text comes, then (index, None) when it ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, r: Relay) -> None:
        try:
            async for p in r.pieces():
                await queue.put((i, p))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(relays)]
    try:
        for _ in range(len(relays)):
            while (item := await queue.get())[1] is not None:
                yield item
            yield item
    finally:
        for t in tasks:  # the client went away: closing each pieces() generator cancels its request
            t.cancel()


async def _chat_stream(state: ServerState, req: ChatCompletionRequest, prompts: list[list[int]],
                       relays: list[Relay], bodies: ChatBodies, split):
    """The n choices stream interleaved, each chunk naming its index; a role chunk first for each.
    `split()` makes a choice's splitter (server/answer.py): reasoning goes out as `reasoning_content`
    deltas; with tools (tool_choice auto), text streams until a tool call opens; the calls come at the end;
    a forced call (required / named, server/tool_stream.py) streams its name and argument deltas."""
    with_usage = bool(req.stream_options and req.stream_options.include_usage)
    splits = [split() for _ in relays]
    pending: list[list] = [[] for _ in relays]  # token events not yet sent with a chunk (their logprobs)

    def chunk(i: int, delta: dict, finish: str | None = None) -> dict:
        lp = chat_logprobs(pending[i], state.text_of) if req.logprobs and pending[i] else None
        pending[i] = []
        return _json(bodies.chunk(delta, finish, logprobs=lp, with_usage=with_usage, index=i))

    for i in range(len(relays)):
        yield _json(bodies.chunk({"role": "assistant", "content": ""}, with_usage=with_usage, index=i))
    async for i, p in _merged(relays):
        r = relays[i]
        if p is not None:
            pending[i].extend(p.events)
            reasoning, text = splits[i].push(p.text)
            if reasoning:
                yield chunk(i, {"reasoning_content": reasoning})
            if text or splits[i].passthrough:
                yield chunk(i, {"content": text})
            if calls := _calls_so_far(splits[i]):
                yield chunk(i, {"tool_calls": calls})
        elif (err := _error_event(r)) is not None:
            yield err
        else:
            reasoning, rest, made = splits[i].finish()
            if reasoning:
                yield chunk(i, {"reasoning_content": reasoning})
            sent = getattr(splits[i], "sent_calls", False)  # (a forced call streamed its deltas already)
            if (delta := _answer_delta(rest or None, [] if sent else made)) or pending[i]:
                yield chunk(i, delta or {"content": ""})
            yield _json(bodies.chunk({}, _finish(r.finish_reason, made), with_usage=with_usage, index=i))
    if with_usage and not any(_error_event(r) for r in relays):
        yield _json({**bodies.usage_chunk(_usage(prompts, relays)), "timings": _timings(relays[0])})
    yield {"data": "[DONE]"}


def _calls_so_far(split) -> list[dict]:
    """The tool-call deltas a forced call's splitter (server/tool_stream.py) has ready; none for the others."""
    take = getattr(split, "take", None)
    return take() if take is not None else []


def _answer_delta(content: str | None, calls: list[dict]) -> dict:
    """A stream delta with an answer's (remaining) text and its tool calls, each naming its index."""
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(calls)]
    return delta


def _finish(reason: str, calls: list[dict]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


async def _completion_stream(state: ServerState, req: CompletionRequest, each: list, prompts: list[list[int]],
                             relays: list[Relay], bodies: CompletionBodies):
    """Every choice (prompts x n) streams interleaved, each chunk naming its index."""
    with_usage = bool(req.stream_options and req.stream_options.include_usage)
    echoed = [False] * len(relays)
    async for i, p in _merged(relays):
        (prompt, ids), r = each[i], relays[i]
        if req.echo and not echoed[i]:  # the prompt first (its scores are ready once a token or the end is)
            echoed[i] = True
            lp = _prompt_lp(state, req, ids, r) if req.logprobs is not None else None
            yield _json(bodies.chunk(i, _echo_text(state, prompt, ids), logprobs=lp, with_usage=with_usage))
        if p is None:
            if (err := _error_event(r)) is not None:
                yield err
            else:
                yield _json(bodies.chunk(i, "", r.finish_reason, with_usage=with_usage))
            continue
        lp = (completion_logprobs([(e.token, e.logprob, e.top) for e in p.events], state.text_of)
              if req.logprobs is not None else None)
        yield _json(bodies.chunk(i, p.text, logprobs=lp, with_usage=with_usage))
    if with_usage:
        yield _json({**bodies.usage_chunk(_usage(prompts, relays)), "timings": _timings(relays[0])})
    yield {"data": "[DONE]"}


def _submit_all(n: int, submit) -> list[Relay]:
    """`submit(i)` for i < n; if one is refused, the ones already queued are cancelled."""
    relays: list[Relay] = []
    try:
        for i in range(n):
            relays.append(submit(i))
    except APIError:
        for r in relays:
            r.handle.cancel()
        raise
    return relays


def _usage(prompts: list[list[int]], relays: list[Relay]) -> dict:
    """Each prompt's tokens once (as OpenAI counts n choices), every choice's completion; cached: per
    prompt, the fewest any of its choices found cached."""
    n = len(relays) // len(prompts)
    cached = sum(min(r.handle.stats.cached_tokens for r in relays[i * n:(i + 1) * n]) for i in range(len(prompts)))
    return usage(sum(len(ids) for ids in prompts), sum(r.handle.stats.generated for r in relays), cached)


def _timings(r: Relay) -> dict:
    """llama-server's `timings` (of the first choice): prompt tokens computed (and cached), their time
    (submit to first token), generated tokens and their time."""
    st = r.handle.stats
    prompt_n, pred_n = st.prompt_tokens - st.cached_tokens, st.generated
    prompt_ms, pred_ms = st.ttft_s * 1e3, st.decode_s * 1e3
    out = {"cache_n": st.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_second": prompt_n / prompt_ms * 1e3 if prompt_ms else 0.0,
           "predicted_n": pred_n, "predicted_ms": pred_ms,
           "predicted_per_second": st.decode_tps}
    if st.drafted:  # (llama-server's names, where it drafted)
        out.update(draft_n=st.drafted, draft_n_accepted=st.accepted)
    return out


def _echo_text(state: ServerState, prompt, ids: list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.tok.decode(ids)


def _prompt_lp(state: ServerState, req: CompletionRequest, ids: list[int], r: Relay) -> dict:
    h = r.handle
    lps = h.prompt_token_logprobs or [None] * len(ids)
    tops = h.prompt_top_logprobs or [None] * len(ids)
    return completion_logprobs(list(zip(ids, lps, tops)), state.text_of)


def _completion_lp(state: ServerState, req: CompletionRequest, ids: list[int], r: Relay, events) -> dict:
    gen = [(e.token, e.logprob, e.top) for e in events]
    if not req.echo:
        return completion_logprobs(gen, state.text_of)
    h = r.handle
    lps = h.prompt_token_logprobs or [None] * len(ids)
    tops = h.prompt_top_logprobs or [None] * len(ids)
    return completion_logprobs(list(zip(ids, lps, tops)) + gen, state.text_of)


def default_model_id(path: str) -> str:
    return Path(path).stem
