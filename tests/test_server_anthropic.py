"""`colibri serve`'s Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens): the official
`anthropic` SDK and raw HTTP against a real process on a free local port (conftest.py), exactness against
transformers and against the chat-completions path, the stream's events (Claude Code's CLI:
test_server_claude_code.py)."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
from types import SimpleNamespace

import pytest
import torch
from chat_server import CLOCK, KEY, MESSAGES, WEATHER
from serve_proc import Server

anthropic = pytest.importorskip("anthropic")

SYSTEM, USER = MESSAGES[0]["content"], [{"role": "user", "content": MESSAGES[1]["content"]}]
GREEDY = {"temperature": 0}
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
CLOCK_TOOL = {"name": "get_time", "input_schema": CLOCK["function"]["parameters"]}
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def ac(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _post(port: int, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
                 {"Content-Type": "application/json", **HEADERS, **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, json.loads(raw)


def _events(port: int, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed answer, as raw SSE."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/messages?beta=true", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **HEADERS})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    text = r.read().decode()
    conn.close()
    out = []
    for chunk in text.replace("\r\n", "\n").split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in chunk.splitlines() if ": " in ln)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_greedy_message_matches_transformers(ac, server, hf):
    """At f32 and temperature 0, the answer is transformers' greedy continuation of the template's rendering,
    whole or streamed (the SDK's messages.stream), with usage counting the prompt (cached or computed)."""
    model, tok = hf
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")]
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=stop,
                         pad_token_id=0)[0, len(ids):]
    want, ended = tok.decode(out, skip_special_tokens=True), out[-1].item() in stop
    kw = dict(model="tiny", system=SYSTEM, messages=USER, max_tokens=16, extra_body=GREEDY)
    r = ac.messages.create(**kw)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want and r.model == "tiny"
    assert r.stop_reason == ("end_turn" if ended else "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids)
    assert r.usage.output_tokens == len(out) - ended and r.id.startswith("msg_")
    # system and content as text blocks: the same prompt, now read from a slot's cache
    blocks = ac.messages.create(**{**kw, "system": [{"type": "text", "text": "You tell"},
                                                    {"type": "text", "text": " stories.", "cache_control": {
                                                        "type": "ephemeral"}}],
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": USER[0][
                                       "content"]}]}]})
    assert blocks.content == r.content and blocks.usage.cache_read_input_tokens > 0
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == len(ids)
    with ac.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want and final.content[0].text == want and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(ids)


def test_the_stream_is_anthropics_event_sequence(server):
    evs = _events(server.port, {"model": "tiny", "system": SYSTEM, "messages": USER, "max_tokens": 8, **GREEDY})
    kinds = [k for k, _ in evs]
    assert all(d["type"] == k for k, d in evs)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert evs[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["delta"]["type"] for k, d in evs if k == "content_block_delta"} == {"text_delta"}
    delta = evs[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8


def test_max_tokens_is_clamped_to_the_context_and_stop_sequences_end_it(ac, client):
    """An agent's max_tokens (32000) beyond the 128-token context: the answer runs to the end of the context, as
    a chat completion asked for exactly that room does; a stop sequence cuts it and is named."""
    # (a timeout given: the SDK refuses an unstreamed 32000 tokens otherwise, expecting them to take minutes)
    r = ac.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=32000, extra_body=GREEDY, timeout=120)
    n = r.usage.input_tokens + r.usage.cache_read_input_tokens
    room = 128 - n
    want = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=room, temperature=0)
    text = want.choices[0].message.content
    assert r.content[0].text == text and r.usage.output_tokens == want.usage.completion_tokens <= room
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert len(text) > 8, "the tiny model's answer is too short for the stop-sequence check"
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = ac.messages.create(model="tiny", system=SYSTEM, messages=USER, max_tokens=32000, extra_body=GREEDY,
                             stop_sequences=["never-there", stop], timeout=120)
    assert cut.content[0].text == text[:text.index(stop)] and cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    with ac.messages.stream(model="tiny", system=SYSTEM, messages=USER, max_tokens=32000, extra_body=GREEDY,
                            stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert final.content[0].text == cut.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_forced_streamed_and_sent_back(ac, client):
    """tool_choice tool / any: a call following the tool's input_schema (as tool_choice named / required gives
    on the chat path), its input streamed as input_json deltas; the call and its result sent back render as
    the chat path renders them (the same prompt tokens, the same greedy answer, count_tokens agrees)."""
    pytest.importorskip("llguidance")
    ask = [{"role": "user", "content": "Paris weather?"}]
    kw = dict(model="tiny", messages=ask, max_tokens=64, tools=[TOOL, CLOCK_TOOL], extra_body=GREEDY)
    r = ac.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and r.stop_reason == "tool_use"
    assert use.input["city"] in ("Paris", "Rome") and 1 <= use.input["days"] <= 7
    o = client.chat.completions.create(model="tiny", messages=ask, max_tokens=64, temperature=0, tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(o.choices[0].message.tool_calls[0].function.arguments) == use.input
    assert o.usage.prompt_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    with ac.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 2 and json.loads("".join(deltas)) == use.input  # as written, not in one piece
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"
    anyone = ac.messages.create(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in anyone.content] == ["tool_use"] and anyone.stop_reason == "tool_use"
    assert anyone.content[0].name in ("get_weather", "get_time")
    back = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                     "input": use.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "sunny"}]}]}]
    r = ac.messages.create(model="tiny", messages=back, tools=[TOOL], max_tokens=6, extra_body=GREEDY)
    oai = ask + [{"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
        "name": use.name, "arguments": json.dumps(use.input)}}]}, {"role": "tool", "tool_call_id": use.id,
                                                                    "content": "sunny"}]
    o = client.chat.completions.create(model="tiny", messages=oai, tools=[WEATHER], max_tokens=6, temperature=0)
    assert r.content[0].text == o.choices[0].message.content and r.stop_reason == "max_tokens"
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == o.usage.prompt_tokens
    assert ac.messages.count_tokens(model="tiny", messages=back, tools=[TOOL]).input_tokens == o.usage.prompt_tokens


def test_structured_output_follows_the_schema(ac):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
              "additionalProperties": False}
    r = ac.messages.create(model="tiny", messages=USER, max_tokens=40, extra_body=GREEDY,
                           output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "high"})
    assert json.loads(r.content[0].text)["color"] in ("red", "green") and r.stop_reason == "end_turn"


class _FakeRelay:
    """A request's text in pieces (the first after `delay` seconds), for the stream assembly alone."""

    stop_hit, finish_reason = False, "stop"

    def __init__(self, parts: list[str], delay: float = 0.0):
        self.parts, self.delay = parts, delay
        self.handle = SimpleNamespace(finish_reason="stop", error=None,
                                      stats=SimpleNamespace(cached_tokens=3, generated=len(parts)))

    async def pieces(self):
        from colibri.server.relay import Piece

        await asyncio.sleep(self.delay)
        for p in self.parts:
            yield Piece(p)


def _collect(relay, split, every=5.0) -> list[dict]:
    from colibri.server.anthropic_stream import events

    async def run():
        return [(e["event"], json.loads(e["data"])) async for e in events("msg_1", "m", 10, relay, split, every)]
    return asyncio.run(run())


def _fold(evs: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks a client builds from the events (as the SDK accumulates them)."""
    blocks: list[dict] = []
    for kind, d in evs:
        if kind == "content_block_start":
            assert d["index"] == len(blocks)
            blocks.append(dict(d["content_block"], partial=""))
        elif kind == "content_block_delta":
            b, delta = blocks[d["index"]], d["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "input_json_delta": "partial_json"}[delta["type"]]
            b["partial" if key == "partial_json" else key] += delta[key]
    for b in blocks:
        partial = b.pop("partial")
        if b["type"] == "tool_use":
            b["input"] = json.loads(partial)
    return blocks


def test_reasoning_and_the_models_own_tool_calls_become_blocks():
    """A thinking model's <think> and a call in its family's format (tool_choice auto: server/tool_formats.py),
    streamed in pieces of any size: thinking, text and tool_use blocks, the same as the whole answer's."""
    from colibri.server.answer import splitter, whole
    from colibri.server.anthropic_answer import blocks

    text = ('<think>\nThe user wants the time.\n</think>\n\nChecking. <tool_call>{"name": "get_time", "arguments": '
            '{"zone": "UTC"}}</tool_call>')
    tools = {"get_time": CLOCK["function"]["parameters"]}
    want = blocks(*whole(splitter("hermes", tools, True, False, True), text))
    assert [(b["type"], b.get("text") or b.get("thinking") or b.get("input")) for b in want] == [
        ("thinking", "The user wants the time."), ("text", "Checking."), ("tool_use", {"zone": "UTC"})]
    for size in (1, 3, 7, len(text)):
        evs = _collect(_FakeRelay([text[i:i + size] for i in range(0, len(text), size)]),
                       splitter("hermes", tools, True, False, True))
        got = _fold(evs)
        got[1]["text"] = got[1]["text"].strip()  # (the stream sends the spacing before the call as it comes)
        assert [{k: v for k, v in b.items() if k != "id"} for b in got] == \
            [{k: v for k, v in b.items() if k != "id"} for b in want], size
        assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
        assert evs[-2][1]["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 3, "output_tokens": len(range(0, len(text), size))}


def test_pings_go_out_while_the_prompt_prefills():
    """Until the first token, a `ping` every `every` seconds (Anthropic's keep-alive), then the content."""
    from colibri.server.answer import splitter

    evs = _collect(_FakeRelay(["Hello"], delay=0.6), splitter("hermes", None, False, False, True), every=0.1)
    kinds = [k for k, _ in evs]
    first = kinds.index("content_block_start")
    assert kinds[0] == "message_start" and kinds[1:first] == ["ping"] * (first - 1) and first - 1 >= 3
    assert "ping" not in kinds[first:] and _fold(evs) == [{"type": "text", "text": "Hello"}]


def test_thinking_history_system_and_prefill_reach_the_template():
    """thinking enabled / disabled set the template's switch (Qwen3's enable_thinking); adaptive leaves its
    default; thinking passed back is the assistant's reasoning_content; Claude Code's billing header leaves the
    system prompt; a mid-conversation system message stays one; a final assistant message is the prefill."""
    from colibri.chat_template import ChatTemplate
    from colibri.server.anthropic import _prompt
    from colibri.server.anthropic_request import MessagesRequest
    from colibri.server.protocol import APIError, parse

    src = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
           "</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.name }} "
           "{{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}{% if add_generation_prompt %}<assistant>"
           "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
    state = SimpleNamespace(template=ChatTemplate(src), template_error=None, tool_format="hermes",
                            tok=SimpleNamespace(encode=lambda t, add_special_tokens: list(t.encode())))

    def text(**body) -> str:
        return _prompt(state, parse(MessagesRequest, json.dumps({"max_tokens": 4096, **body}).encode())).text

    hi = [{"role": "user", "content": "Hi"}]
    assert text(messages=hi, thinking={"type": "disabled"}) == "<user>Hi<assistant><think></think>"
    assert text(messages=hi, thinking={"type": "enabled", "budget_tokens": 2048}) == "<user>Hi<assistant>"
    assert text(messages=hi, thinking={"type": "adaptive"}) == text(messages=hi) == "<user>Hi<assistant>"
    history = hi + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Plan.", "signature": "sig"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "text", "text": "Sure."}, {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                     {"type": "text", "text": "Go on."}]},
        {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Well,"}]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=12345;"},
              {"type": "text", "text": "You help."}]
    assert text(messages=history, system=system) == (
        '<system>You help.<user>Hi<assistant><think>Plan.</think>Sure.[f {"a": 1}]<tool>ok<user>Go on.'
        '<system>Be brief.<assistant>Well,')
    with pytest.raises(APIError, match="trailing whitespace"):
        text(messages=hi + [{"role": "assistant", "content": "Well, "}])


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": USER, "max_tokens": "many"}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [], "max_tokens": 5}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 5}, 400, "invalid_request_error", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}],
      "max_tokens": 5}, 400, "invalid_request_error", "'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}], "max_tokens": 5}, 400,
     "invalid_request_error", "'document'"),
    ({"messages": USER, "max_tokens": 5, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "input_schema"),
    ({"messages": USER, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "web_search_20250305"),
    ({"messages": USER, "max_tokens": 5, "tools": [TOOL], "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error", "name"),
    ({"messages": USER, "max_tokens": 5, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "nope"),
    ({"messages": USER, "max_tokens": 5, "thinking": {"type": "enabled"}}, 400, "invalid_request_error", "budget"),
    ({"messages": USER, "max_tokens": 5, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"messages": USER, "max_tokens": 5, "stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
    ({"messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 5}, 400, "invalid_request_error",
     "prompt is too long"),
    ({"messages": USER, "max_tokens": 5, "model": "gpt-4"}, 404, "not_found_error", "gpt-4"),
    (b"{not json", 400, "invalid_request_error", "JSON"),
])
def test_bad_requests_get_anthropic_errors(server, body, status, kind, says):
    got, r = _post(server.port, "/v1/messages", body)
    assert (got, r["type"], r["error"]["type"]) == (status, "error", kind), r
    assert says in r["error"]["message"] and "Traceback" not in r["error"]["message"]


def test_count_tokens_models_auth_and_errors(ac, server):
    r = ac.messages.create(model="claude-sonnet-4-5", system=SYSTEM, messages=USER, max_tokens=1)  # (Claude Code's)
    count = ac.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER)
    assert r.model == "tiny" and count.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    (card,) = ac.models.list().data
    assert (card.id, card.type, card.display_name) == ("tiny", "model", "tiny")
    assert ac.models.retrieve("tiny").id == "tiny"
    assert server.request("GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}"})[1]["object"] == "list"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model="tiny", system=SYSTEM, messages=USER).input_tokens == count.input_tokens
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="tiny", messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert "'image'" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        ac.models.retrieve("gpt-4")
    # Claude Code's fields: accepted and ignored, with ?beta=true
    body = {"model": "claude-opus-4-8", "system": SYSTEM, "messages": USER, "max_tokens": 64000, **GREEDY,
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "service_tier": "auto", "speed": "fast"}
    status, got = _post(server.port, "/v1/messages?beta=true", body, {"anthropic-beta": "claude-code-20250219"})
    assert status == 200 and got["stop_reason"] in ("end_turn", "max_tokens") and got["content"]
    for method, path, want in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/nope", 404)):
        status, err = server.request(method, path, {}, HEADERS)
        assert status == want and err["type"] == "error" and err["error"]["message"], err
    # 413: the body's announced size is refused before it is read
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-api-key: " +
                     KEY.encode() + b"\r\nContent-Length: 40000000\r\n\r\n{")
        sock.settimeout(30)
        head = b""
        while b"request_too_large" not in head and (more := sock.recv(4096)):
            head += more
    assert head.startswith(b"HTTP/1.1 413") and b"request_too_large" in head


def _wait_idle(s: Server, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while (busy := s.request("GET", "/health")[1]["busy"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return busy


def test_full_queue_is_overloaded_and_a_dropped_stream_frees_its_slot(chat_model):
    """One slot, no queue: an Anthropic request finding it taken gets 529 overloaded_error; a client that goes
    away mid-stream cancels its request (its slot is free again long before its 3000 tokens)."""
    s = Server(chat_model[1], "--slots", "1", "--max-queue", "0", "--ctx-size", "4096")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon", "max_tokens": 3000,
                                                            "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().readline().startswith(b"data: ")
        status, r = _post(s.port, "/v1/messages", {"messages": USER, "max_tokens": 4})
        assert status == 529 and r["error"]["type"] == "overloaded_error"
        conn.close()
        assert _wait_idle(s) == 0
        # a long answer, dropped after its first delta
        body = {"messages": [{"role": "user", "content": "Once upon"}], "max_tokens": 3000, "stream": True, **GREEDY}
        sock = socket.create_connection(("127.0.0.1", s.port))
        data = json.dumps(body).encode()
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        got = b""
        while b"content_block_delta" not in got:
            got += sock.recv(4096)
        assert s.request("GET", "/health")[1]["busy"] == 1
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        assert _wait_idle(s, 5) == 0
    finally:
        out = s.stop()
    assert "Traceback" not in out
    (line,) = [ln for ln in out.splitlines() if " messages: prompt " in ln]
    n = int(re.search(r"completion (\d+) tok", line).group(1))
    assert line.endswith("finish cancelled") and n < 3000, line
