"""`colibri serve`'s other ways in, against its chat path: structured output, tool calls, reasoning
split, OpenAI's Responses API and Ollama's API (a real process on a free local port; conftest.py)."""

from __future__ import annotations

import http.client
import json

import pytest
from chat_server import AUTH, CLOCK, MESSAGES, PICK, WEATHER

openai = pytest.importorskip("openai")


def test_tool_calls_required_named_streamed_and_sent_back(client):
    pytest.importorskip("llguidance")
    ask = [{"role": "user", "content": "Paris weather?"}]
    kw = dict(model="tiny", messages=ask, max_tokens=64, temperature=0)
    plain = client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    tc = c.message.tool_calls[0]
    args = json.loads(tc.function.arguments)
    assert (tc.function.name, set(args)) in (("get_weather", {"city", "days"}), ("get_time", {"zone"}))
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the template wrote the tools into the prompt
    named = client.chat.completions.create(**kw, tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
    chunks = list(client.chat.completions.create(**kw, tools=[WEATHER, CLOCK], tool_choice="required",
                                                 parallel_tool_calls=False, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == tc.function.name and {d.index for d in deltas} == {0}
    assert len(deltas) > 2  # the arguments streamed as they were written, not in one piece at the end
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(tc.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    chunks = list(client.chat.completions.create(**kw, tools=[WEATHER, CLOCK], stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # (greedy: the same)
    # The call and its result go back in the next turn (auto: this random model answers in text).
    back = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=back, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.usage.prompt_tokens > named.usage.prompt_tokens



def test_auto_tool_calls_in_the_models_own_words(client):
    """tool_choice auto: a call the model writes (here forced by a grammar, as a model trained for it
    would write it) comes back as tool_calls, streamed or not; text around it stays content."""
    pytest.importorskip("llguidance")
    gbnf = ('root ::= "Checking. <tool_call>{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"" '
            '("UTC" | "CET") "\\"}}</tool_call>"')
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, CLOCK], max_tokens=80,
              temperature=0, extra_body={"grammar": gbnf})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    (tc,) = c.message.tool_calls
    assert tc.function.name == "get_time" and json.loads(tc.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert text.strip() == "Checking." and "<tool_call>" not in text
    assert [(d.function.name, d.function.arguments) for d in calls] == [(tc.function.name, tc.function.arguments)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # no call written: the streamed text is the plain answer's
    plain = dict(kw, extra_body={}, max_tokens=12)
    whole = client.chat.completions.create(**plain).choices[0].message.content
    chunks = list(client.chat.completions.create(**plain, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole



def test_gpt_oss_channels_through_the_server(chat_model):
    """--tool-parser harmony (gpt-oss's format; auto-detected from its template): the analysis channel is
    reasoning_content, a commentary message to functions.NAME a tool call, plain and streamed."""
    pytest.importorskip("llguidance")
    from serve_proc import Server

    s = Server(chat_model[1], "--tool-parser", "harmony", "--ctx-size", "512")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        gbnf = ('root ::= "<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant<|channel|>'
                'commentary to=functions.get_weather <|constrain|>json<|message|>{\\"city\\": \\"" '
                '("Paris" | "Rome") "\\", \\"days\\": 3}"')
        kw = dict(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Weather?"}],
                  tools=[WEATHER], max_tokens=300, temperature=0, extra_body={"grammar": gbnf})
        r = c.chat.completions.create(**kw).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.reasoning_content == "Needs the weather."
        assert r.message.content is None
        (tc,) = r.message.tool_calls
        assert tc.function.name == "get_weather" and json.loads(tc.function.arguments)["days"] == 3
        deltas = [ch.choices[0].delta for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Needs the weather."
        assert not "".join(d.content or "" for d in deltas)
        calls = [t.function for d in deltas for t in (d.tool_calls or [])]
        assert [(f.name, f.arguments) for f in calls] == [(tc.function.name, tc.function.arguments)]
        final = dict(kw, tools=None, extra_body={"grammar": 'root ::= "<|channel|>final<|message|>Sunny."'})
        m = c.chat.completions.create(**final).choices[0].message
        assert (m.content, getattr(m, "reasoning_content", None)) == ("Sunny.", None)
    finally:
        s.stop()


def test_reasoning_goes_to_reasoning_content(client):
    """A thinking model's <think> ... </think> (forced here by a grammar) leaves content, plain and streamed."""
    pytest.importorskip("llguidance")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=60, temperature=0,
              extra_body={"grammar": 'root ::= "<think>\\nI should greet.\\n</think>\\n\\n" ("Hello!" | "Hi!")'})
    m = client.chat.completions.create(**kw).choices[0].message
    assert m.reasoning_content == "I should greet." and m.content in ("Hello!", "Hi!")
    chunks = [ch.choices[0].delta for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == "I should greet."
    assert "".join(d.content or "" for d in chunks) == m.content



def test_responses_api_text_json_tools_and_stream(client):
    """POST /v1/responses through the official client: the text of the equivalent chat completion, JSON
    by schema, function calls, the event stream, and a conversation with a call's output sent back."""
    pytest.importorskip("llguidance")
    want = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}])
    kw = dict(model="tiny", instructions="You tell stories.", input="Once upon a time", max_output_tokens=12,
              temperature=0)
    r = client.responses.create(**kw)
    assert r.output_text == want.choices[0].message.content and r.usage.input_tokens == want.usage.prompt_tokens
    assert r.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[0].type == "response.created" and events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    r = client.responses.create(model="tiny", input="Pick", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": PICK}})
    assert set(json.loads(r.output_text)) == {"color", "n"}
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model="tiny", input="Paris weather?", tools=[tool], tool_choice="required",
                                max_output_tokens=64, temperature=0)
    (fc,) = [o for o in r.output if o.type == "function_call"]
    assert fc.name == "get_weather" and json.loads(fc.arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(model="tiny", input="Paris weather?", tools=[tool], tool_choice="required",
                                          max_output_tokens=64, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done] == [(fc.name, fc.arguments)]
    back = [{"role": "user", "content": "Paris weather?"}, fc.model_dump(),
            {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}]
    r = client.responses.create(model="tiny", input=back, tools=[tool], max_output_tokens=4, temperature=0)
    assert r.output_text and r.usage.input_tokens > 10



def test_responses_are_stored_continued_retrieved_and_deleted(client):
    """store (the default): previous_response_id continues a conversation as sending it whole does (without
    the earlier instructions); GET / DELETE /v1/responses/{id}, GET .../input_items (order, limit, after);
    store false and unknown ids."""
    kw = dict(model="tiny", max_output_tokens=6, temperature=0)
    first = client.responses.create(input="Once upon a time", instructions="You tell stories.", **kw)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **kw)
    whole = client.responses.create(input=[{"role": "user", "content": "Once upon a time"},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "And then?"}], **kw)
    assert second.output_text == whole.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens == whole.usage.input_tokens
    streamed = list(client.responses.create(input="Go on.", previous_response_id=second.id, stream=True, **kw))
    third = client.responses.retrieve(streamed[-1].response.id)
    assert third.output_text == streamed[-1].response.output_text and third.previous_response_id == second.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    # input_items: the request's own input (not the earlier turns), newest first, paged
    mine = client.responses.input_items.list(second.id).data
    assert [(it.role, it.content[0].text) for it in mine] == [("user", "And then?")]
    items = client.responses.input_items.list(whole.id, order="asc").data
    assert [(it.role, it.content[0].type, it.content[0].text) for it in items] == [
        ("user", "input_text", "Once upon a time"), ("assistant", "output_text", first.output_text),
        ("user", "input_text", "And then?")]
    page = client.responses.input_items.list(whole.id, limit=2)
    assert [it.id for it in page.data] == [items[2].id, items[1].id] and page.has_more
    rest = client.responses.input_items.list(whole.id, limit=2, after=items[1].id)
    assert [it.id for it in rest.data] == [items[0].id] and not rest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(whole.id, limit=0)
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.input_items.list(first.id),
                 lambda: client.responses.create(input="x", previous_response_id=first.id, **kw)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(input="x", store=False, **kw)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)



def _ndjson(port: int, path: str, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **AUTH})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type") == "application/x-ndjson"
    lines = [json.loads(ln) for ln in r.read().decode().splitlines() if ln.strip()]
    conn.close()
    return lines



def test_ollama_api_chat_generate_tags(server, client):
    """Ollama's routes answer as the OpenAI ones do (same template, sampling and text), in Ollama's shapes."""
    want = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    opts = {"temperature": 0, "num_predict": 10}
    status, r = server.request("POST", "/api/chat", {"model": "tiny", "messages": MESSAGES, "stream": False,
                                                      "options": opts}, AUTH)
    assert status == 200 and r["done"] and r["message"]["content"] == want.choices[0].message.content
    assert r["prompt_eval_count"] == want.usage.prompt_tokens and r["eval_count"] == want.usage.completion_tokens
    assert r["eval_duration"] > 0 and r["total_duration"] >= r["eval_duration"]
    lines = _ndjson(server.port, "/api/chat", {"model": "tiny:latest", "messages": MESSAGES, "options": opts})
    assert "".join(ln["message"]["content"] for ln in lines) == r["message"]["content"]
    assert [ln["done"] for ln in lines][-1] and not any(ln["done"] for ln in lines[:-1])
    assert lines[-1]["eval_count"] == r["eval_count"] and lines[-1]["done_reason"] == r["done_reason"]
    # generate: the template's user turn (+ system), or raw text as /v1/completions
    status, g = server.request("POST", "/api/generate", {"prompt": "Once upon a time", "system": "You tell stories.",
                                                          "stream": False, "options": opts}, AUTH)
    assert status == 200 and g["response"] == r["message"]["content"]
    # Ollama's `think` (true / false / a level) is accepted; this template reads none of its switches
    for think in (True, False, "low"):
        body = {"prompt": "Once upon a time", "system": "You tell stories.", "stream": False, "options": opts,
                "think": think}
        status, t = server.request("POST", "/api/generate", body, AUTH)
        assert status == 200 and t["response"] == g["response"] and "thinking" not in t, think
    raw = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    lines = _ndjson(server.port, "/api/generate", {"prompt": "Once upon a time", "raw": True, "options": opts})
    assert "".join(ln["response"] for ln in lines) == raw.choices[0].text
    status, j = server.request("POST", "/api/chat", {"messages": MESSAGES, "stream": False, "format": PICK,
                                                      "options": {"temperature": 0, "num_predict": 64}}, AUTH)
    assert set(json.loads(j["message"]["content"])) == {"color", "n"}
    tags = server.request("GET", "/api/tags", None, AUTH)[1]
    assert [m["name"] for m in tags["models"]] == ["tiny:latest"]
    info = server.request("POST", "/api/show", {"model": "tiny"}, AUTH)[1]["model_info"]
    assert info["colibri.context_length"] == 128
    assert "version" in server.request("GET", "/api/version", None, AUTH)[1]
    status, err = server.request("POST", "/api/chat", {"model": "llama3", "messages": MESSAGES}, AUTH)
    assert status == 404 and "llama3" in err["error"]  # Ollama's error shape: the text
    status, err = server.request("POST", "/api/generate", {"prompt": "x", "options": {"temperature": -1}}, AUTH)
    assert status == 400 and isinstance(err["error"], str)
    assert server.request("POST", "/api/chat", {"messages": MESSAGES}, {})[0] == 401



def test_repeat_penalty_window_defaults_to_llama_cpp_and_ollama():
    """The server routes' repeat_last_n is theirs (64, -1 the whole context, 0 none) and reaches the engine."""
    from colibri.engine.request import SamplingParams
    from colibri.server.ollama import Options, _sampling
    from colibri.server.protocol import ChatCompletionRequest

    assert _sampling(None, None)["repeat_last_n"] == 64 and _sampling(None, None)["repeat_penalty"] == 1.1
    assert _sampling(Options(repeat_last_n=-1), None)["repeat_last_n"] == -1
    kw = ChatCompletionRequest(messages=MESSAGES, repeat_penalty=1.2).sampling_kw()
    assert kw["repeat_last_n"] == 64
    assert ChatCompletionRequest(messages=MESSAGES, repeat_last_n=0).sampling_kw()["repeat_last_n"] == 0
    SamplingParams(**{k: v for k, v in kw.items() if k != "grammar"}).validate()


def test_think_split_streams_what_the_whole_split_gives():
    from colibri.server.answer import splitter, whole
    from colibri.server.reasoning import ThinkSplit, opens_thinking

    cases = [("<think>\nplan a\nplan b\n</think>\n\nThe answer.", False, ("plan a\nplan b", "The answer.")),
             ("plan</think> ans", True, ("plan", "ans")), ("<think>unfinished", False, ("unfinished", "")),
             ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),
             (" \n<think>x</think>y", False, ("x", "y")),
             ("<th", False, ("", "<th")), ("a < b </thinking> c", True, ("a < b </thinking> c", ""))]
    for text, opened, want in cases:
        assert whole(splitter("hermes", None, True, opened, True), text)[:2] == want, text
        for size in (1, 2, 3, 5):
            s = ThinkSplit(opened)
            parts = [s.push(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want, (text, size)
    assert opens_thinking("<|assistant|><think>\n") and not opens_thinking("<think>x</think>")
    assert not opens_thinking("<|assistant|>\n")



def test_structured_output_follows_the_schema(client):
    pytest.importorskip("llguidance")
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0,
                                       response_format=fmt)
    obj = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop" and set(obj) == {"color", "n"} and 0 <= obj["n"] <= 99
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    # llama-server's json_schema field, on completions, sampled
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=64, temperature=1.0, seed=4,
                                  extra_body={"json_schema": PICK})
    assert json.loads(r.choices[0].text)["color"] in ("red", "green", "blue")
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=16, temperature=1.0, seed=2,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") "!"'})
    assert r.choices[0].text in ("yes!", "no!") and r.choices[0].finish_reason == "stop"
