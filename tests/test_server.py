"""`colibri serve` as a real process on a free local port: the official openai client (chat and
completions, streamed and not), raw HTTP for errors, and exactness against transformers."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hf_tiny import hf_greedy, hf_logits, load_hf
from serve_proc import Server

from colibri.engine.kv import common_prefix

openai = pytest.importorskip("openai")

KEY = "sk-test-colibri"
# GLM-style: the template writes the next turn's marker, and <|user|> (one token in the tiny
# vocabulary) is then the template's stop token.
TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% elif m['role'] in ('system', 'tool') %}"
            "<|system|>{% else %}<|assistant|>{% endif %}\n{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
            "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(HF folder with chat_template.jinja, its f32 container)."""
    hf = tmp_path_factory.mktemp("srv") / "hf"
    shutil.copytree(ckpt.hf("mixtral"), hf)
    (hf / "chat_template.jinja").write_text(TEMPLATE)
    from colibri.convert import convert

    return hf, convert(hf, hf.parent / "m.coli", "f32", 32, progress=False)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    s = Server(chat_model[1], "--api-key", KEY, "--model-id", "tiny", "--slots", "4", "--ctx-size", "128",
               "--slot-save-path", str(tmp_path_factory.mktemp("slots")), "--allowed-origins", "http://ui.test")
    yield s
    err = s.stop()
    assert s.proc.returncode == 0, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf(chat_model):
    from transformers import AutoTokenizer

    return load_hf(chat_model[0]), AutoTokenizer.from_pretrained(chat_model[0])


MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]


def test_greedy_chat_matches_transformers(client, hf):
    model, tok = hf
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")]
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=stop,
                         pad_token_id=0)[0, len(ids):]
    want = tok.decode(out, skip_special_tokens=True)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out) - (out[-1].item() in stop)
    assert r.choices[0].finish_reason == ("stop" if out[-1].item() in stop else "length")
    # streamed: the same text in deltas, finish_reason last, usage in the extra final chunk
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_a_chat_turn_reuses_the_conversation_so_far(server, client, hf):
    """The second turn re-sends the first: its slot's cache serves that prefix, the answer stays
    transformers' answer, and usage and /metrics count the cached tokens."""
    model, tok = hf
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    ids1 = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert first.usage.prompt_tokens_details.cached_tokens < len(ids1)
    turn2 = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And then?"}]
    r = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids2 = tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.choices[0].message.content == tok.decode(hf_greedy(model, ids2, 10), skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids2)
    # The slot holds the first turn's prompt (and answer): at least what the two prompts share is reused
    # (the generation prompt's last token may merge with the answer's first characters when re-tokenized).
    shared = common_prefix(ids1, ids2)
    assert shared >= len(ids1) - 1
    assert shared <= r.usage.prompt_tokens_details.cached_tokens < len(ids2)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("colibri_prompt_tokens_cached_total"))
    assert float(line.split()[-1]) >= shared


def test_echo_prompt_logprobs_match_transformers(client, hf):
    model, tok = hf
    ids = tok("Once upon a time there was a little girl").input_ids
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ref = torch.log_softmax(hf_logits(model, ids), -1)  # [T, V]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    want = torch.tensor([ref[t - 1, ids[t]].item() for t in range(1, len(ids))])
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    best = ref[0].topk(2)
    top = lp.top_logprobs[1]  # about token 1: the two most likely after token 0
    assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert r.choices[0].text == tok.decode(ids, skip_special_tokens=True) and r.usage.completion_tokens == 0


def test_concurrent_streams_get_their_solo_output(client):
    prompts = ["Once upon a time", "The weather was", "What is the capital of France?", "She sells sea"]

    def solo(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def streamed(p):
        return "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))

    alone = [solo(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == alone and len(set(alone)) > 1


def test_multiple_prompts_and_seeded_sampling(client):
    r = client.completions.create(model="tiny", prompt=["Once upon", "The quick"], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    one = client.completions.create(model="tiny", prompt="The quick", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[1].text == one.choices[0].text

    def sample(seed):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.5,
                                           seed=seed, top_p=0.95, extra_body={"top_k": 50})
        return r.choices[0].message.content

    assert sample(3) == sample(3) != sample(4)


def test_n_choices_are_the_requests_with_seed_plus_i(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.5, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50})
    r = client.chat.completions.create(**kw, n=3, seed=3)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    singles = [client.chat.completions.create(**kw, seed=3 + i) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens and r.usage.completion_tokens == 36
    chunks = list(client.chat.completions.create(**kw, n=3, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    got = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
    assert got == texts and chunks[-1].usage.completion_tokens == 36
    assert sorted(ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason) == ["length"] * 3
    ckw = dict(model="tiny", max_tokens=5, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(**ckw, prompt=["Once upon", "The quick"], n=2, seed=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt i's choice j is i * n + j
    assert r.choices[3].text == client.completions.create(**ckw, prompt="The quick", seed=3).choices[0].text
    assert r.choices[0].text == client.completions.create(**ckw, prompt="Once upon", seed=2).choices[0].text


def test_stop_strings_split_across_tokens(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw, logprobs=True, extra_body={"ignore_eos": True})
    toks = [t.token for t in full.choices[0].logprobs.content]
    text = full.choices[0].message.content
    assert "".join(toks) == text
    k = next(i for i in range(2, len(toks)) if toks[i] and toks[i - 1])
    stop = toks[k - 1][-1] + toks[k][0]  # the last character of one token and the first of the next
    want = text[: text.index(stop)]
    r = client.chat.completions.create(**kw, stop=[stop, "never-there"], extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs_and_penalties(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.logprob <= 0
    plain = r.choices[0].message.content
    pen = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                         frequency_penalty=2.0, presence_penalty=2.0,
                                         extra_body={"ignore_eos": True, "repeat_penalty": 1.5})
    assert pen.choices[0].message.content != plain  # the penalties reach the sampler


def test_logit_bias_forces_and_bans_tokens(client, hf):
    model, tok = hf
    ids = tok("Once upon a time").input_ids
    logits = hf_logits(model, ids)[-1]  # [V]
    low, best = int(logits.argmin()), int(logits.argmax())
    kw = dict(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    forced = client.completions.create(**kw, logit_bias={str(low): 100})
    assert forced.choices[0].logprobs.tokens == [tok.decode([low])]
    plain = client.completions.create(**kw)
    banned = client.completions.create(**kw, logit_bias={str(best): -100})
    assert plain.choices[0].logprobs.tokens == [tok.decode([best])] != banned.choices[0].logprobs.tokens


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, h = server.request("GET", "/health")
    assert status == 200 and h["slots"] == 4 and h["free"] + h["busy"] == 4 and h["queued"] == 0
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for name in ("colibri_requests_total", "colibri_prompt_tokens_total", "colibri_generation_tokens_total",
                 "colibri_time_to_first_token_seconds_bucket", "colibri_inter_token_latency_seconds_bucket",
                 "colibri_expert_cache_hit_rate", "colibri_disk_read_bytes_total", "colibri_slots_busy"):
        assert name in text, name
    assert float(next(ln.split()[-1] for ln in text.splitlines()
                      if ln.startswith("colibri_generation_tokens_total"))) > 0


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


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
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(tc.function.name, tc.function.arguments)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
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
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")


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


def test_think_split_streams_what_the_whole_split_gives():
    from colibri.server.reasoning import ThinkSplit, opens_thinking, split

    cases = [("<think>\nplan a\nplan b\n</think>\n\nThe answer.", False, ("plan a\nplan b", "The answer.")),
             ("plan</think> ans", True, ("plan", "ans")), ("<think>unfinished", False, ("unfinished", "")),
             ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),
             (" \n<think>x</think>y", False, ("x", "y")),
             ("<th", False, ("", "<th")), ("a < b </thinking> c", True, ("a < b </thinking> c", ""))]
    for text, opened, want in cases:
        assert split(text, opened) == want, text
        for size in (1, 2, 3, 5):
            s = ThinkSplit(opened)
            parts = [s.push(text[i:i + size]) for i in range(0, len(text), size)] + [s.finish()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want, (text, size)
    assert opens_thinking("<|assistant|><think>\n") and not opens_thinking("<think>x</think>")
    assert not opens_thinking("<|assistant|>\n")


def test_hermes_stream_holds_back_only_what_may_open_a_call():
    from colibri.server.tools import HermesStream

    text = 'a < b, <tool; then <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> done'
    for size in (1, 2, 3, 7):
        s = HermesStream({"f"})
        sent = "".join(s.push(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = s.finish()
        assert sent == "a < b, <tool; then " and rest == "done" and calls[0]["function"]["name"] == "f"
    s = HermesStream({"f"})
    assert s.push("x <tool_") == "x " and s.finish() == ("<tool_", [])


def test_hermes_tool_calls_are_parsed_out_of_the_text():
    from colibri.server.tools import hermes_calls

    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
            '</tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{broken</tool_call>')
    content, calls = hermes_calls(text, {"get_weather"})
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    assert content.startswith("Let me check.") and "get_weather" not in content and "nope" in content
    assert hermes_calls("no calls here", {"get_weather"}) == ("no calls here", [])



PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["color", "n"], "additionalProperties": False}


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



def test_slots_save_erase_and_restore(server, hf):
    model, tok = hf
    doc = tok("Once upon a time there was a little girl who lived in a village near the forest, and "
              "every morning she walked to the river").input_ids
    for i in range(4):  # what earlier tests left in the slots
        assert server.request("POST", f"/slots/{i}?action=erase", None, AUTH)[0] == 200
    assert server.request("POST", "/v1/completions", {"prompt": doc, "max_tokens": 1}, AUTH)[0] == 200
    status, slots = server.request("GET", "/slots", None, AUTH)
    assert status == 200 and [s["id"] for s in slots] == [0, 1, 2, 3] and {s["n_ctx"] for s in slots} == {128}
    (held,) = [s for s in slots if s["n_cached"]]
    assert held["n_cached"] == len(doc) and not held["busy"] and held["request_id"] is None
    status, r = server.request("POST", f"/slots/{held['id']}?action=save", {"filename": "doc.bin"}, AUTH)
    assert status == 200 and r["n_saved"] == held["n_cached"] and r["n_written"] > 0
    for s in slots:
        assert server.request("POST", f"/slots/{s['id']}?action=erase", None, AUTH)[1]["n_erased"] == s["n_cached"]
    assert {s["n_cached"] for s in server.request("GET", "/slots", None, AUTH)[1]} == {0}
    status, r = server.request("POST", "/slots/2?action=restore", {"filename": "doc.bin"}, AUTH)
    assert status == 200 and r["n_restored"] == held["n_cached"]
    question = doc + tok(" and then", add_special_tokens=False).input_ids
    body = {"prompt": question, "max_tokens": 6, "ignore_eos": True}
    status, r = server.request("POST", "/v1/completions", body, AUTH)
    assert status == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(doc)
    assert r["choices"][0]["text"] == tok.decode(hf_greedy(model, question, 6), skip_special_tokens=True)
    for path, body, want, code in (
            ("/slots/0?action=nap", {"filename": "a"}, 400, "invalid_value"),
            ("/slots/9?action=save", {"filename": "a"}, 404, "slot_not_found"),
            ("/slots/0?action=save", {"filename": "../evil"}, 400, "invalid_value"),
            ("/slots/0?action=restore", {"filename": "missing.bin"}, 404, "slot_file_not_found")):
        status, r = server.request("POST", path, body, AUTH)
        assert status == want and r["error"]["code"] == code, (path, r)
    assert server.request("GET", "/slots", None, {})[0] == 401



def test_tokenize_and_detokenize(server, hf):
    _, tok = hf
    text = "Once upon a time there was"
    status, r = server.request("POST", "/tokenize", {"prompt": text, "with_pieces": True}, AUTH)
    assert status == 200 and r["tokens"] == tok(text).input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128 and r["pieces"] == [tok.decode([i]) for i in r["tokens"]]
    assert server.request("POST", "/tokenize", {"content": text, "add_special_tokens": False},
                          AUTH)[1]["tokens"] == tok(text, add_special_tokens=False).input_ids
    status, r = server.request("POST", "/tokenize", {"messages": MESSAGES}, AUTH)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert status == 200 and r["tokens"] == ids
    status, back = server.request("POST", "/detokenize", {"tokens": ids}, AUTH)
    assert status == 200 and back["prompt"] == tok.decode(ids)
    for path, body in (("/tokenize", {"prompt": "a", "messages": MESSAGES}), ("/tokenize", {}),
                       ("/detokenize", {"tokens": [1, 99999]}), ("/detokenize", {"tokens": "1 2"})):
        status, r = server.request("POST", path, body, AUTH)
        assert status == 400 and r["error"]["code"] == "invalid_value", (path, body, r)
    assert server.request("POST", "/tokenize", {"prompt": "a"}, {})[0] == 401



@pytest.mark.parametrize("path, body, status, code", [
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "many"}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 500}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "Hi", "n": 2, "best_of": 3}, 400, "unsupported_value"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"five": 1}}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": -100}}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "missing_parameter"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "Hi", "json_schema": {"type": "object"}, "response_format": {
        "type": "json_object"}}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "Hi", "grammar": "root ::= ("}, 400, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model_not_found"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "missing_parameter"),
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", {"prompt": "word " * 200, "max_tokens": 1}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": []}, 400, "invalid_value"),
    ("/v1/nope", {}, 404, "unknown_url"),
    ("/v1/responses", {"input": "x", "text": {"format": "x"}}, 400, "invalid_value"),
    ("/v1/responses", {"input": [{"type": "function_call"}]}, 400, "invalid_value"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "invalid_value"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "unsupported_parameter"),
    ("/v1/responses", {"input": "x", "tool_choice": {"type": "function"}}, 400, "invalid_value"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, 400, "invalid_value"),
    ("/v1/responses", {}, 400, "missing_parameter"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, code):
    got, r = server.request("POST", path, body, AUTH)
    assert got == status, r
    assert set(r["error"]) >= {"message", "type", "code"} and r["error"]["code"] == code
    assert "Traceback" not in r["error"]["message"] and "\n" not in r["error"]["message"]


def test_cors_lets_the_allowed_origin_call_from_a_browser(server):
    def ask(method: str, origin: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(method, "/v1/chat/completions", None if method == "OPTIONS" else json.dumps(CHAT),
                     {"Origin": origin, "Access-Control-Request-Method": "POST",
                      "Access-Control-Request-Headers": "authorization,content-type",
                      **({} if method == "OPTIONS" else AUTH)})
        r = conn.getresponse()
        r.read()
        return r

    pre = ask("OPTIONS", "http://ui.test")  # the preflight carries no key: answered before the key check
    assert pre.status == 200 and pre.getheader("access-control-allow-origin") == "http://ui.test"
    assert ask("POST", "http://ui.test").getheader("access-control-allow-origin") == "http://ui.test"
    assert ask("OPTIONS", "http://evil.test").getheader("access-control-allow-origin") is None


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, r = server.request("POST", "/v1/chat/completions", CHAT, headers)
        assert status == 401 and r["error"]["code"] == "invalid_api_key"
    assert server.request("GET", "/v1/models", None, {})[0] == 401
    assert server.request("GET", "/v1/models", None, AUTH)[0] == 200


def _open_stream(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # the first token is out: the request holds the slot
    return conn, r


def _busy(s: Server) -> int:
    return s.request("GET", "/health")[1]["busy"]


def test_queue_full_disconnect_and_shutdown(chat_model):
    """One slot, no queue: a second request gets 429; a client that goes away frees its slot; SIGTERM
    refuses new requests with 503 and lets the running one finish."""
    # The grace outlasts the 1500-token stream below on a slow machine (~9 s on the reference VM: the
    # default 10 s cancelled it there once).
    s = Server(chat_model[1], "--slots", "1", "--max-queue", "0", "--ctx-size", "4096", "--shutdown-grace", "120")
    try:
        long = {"prompt": "Once upon", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        conn, _ = _open_stream(s.port, long)
        status, r = s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 429 and r["error"]["code"] == "queue_full"
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 5
        while _busy(s) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _busy(s) == 0  # freed long before its 3000 tokens
        conn, stream = _open_stream(s.port, {**long, "max_tokens": 1500})
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        status, r = s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and r["error"]["code"] == "shutting_down"
        events = [ln for ln in stream.read().decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=30) == 0
    finally:
        err = s.stop()
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if " completions: prompt " in ln]  # one per request that ran
    assert len(lines) == 2 and lines[0].endswith("finish cancelled") and lines[1].endswith("finish length")
    assert "completion 1500 tok" in lines[1] and "TTFT" in lines[1] and "tok/s" in lines[1]


def test_shutdown_grace_cancels_what_still_runs(chat_model):
    """--shutdown-grace 0: a stream still running at SIGTERM is cancelled at once (it ends with an error
    event, not its 3000 tokens) and the process exits 0."""
    s = Server(chat_model[1], "--slots", "1", "--ctx-size", "4096", "--shutdown-grace", "0")
    try:
        _, stream = _open_stream(s.port, {"prompt": "Once upon", "max_tokens": 3000, "temperature": 0,
                                          "ignore_eos": True})
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        events = [ln for ln in stream.read().decode().splitlines() if ln.startswith("data: ")]
        assert s.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10  # not the default 10 s, nor the 3000 tokens
        tail = [json.loads(e[6:]) for e in events if e != "data: [DONE]"][-1]
        assert "error" in tail and "choices" not in tail, tail
        assert len(events) < 3000
    finally:
        err = s.stop()
    assert "Traceback" not in err
    assert any(" completions: prompt " in ln and ln.endswith("finish cancelled") for ln in err.splitlines()), err


def test_relay_sends_an_empty_piece_for_a_token_without_text():
    """A token that decodes to nothing still reaches the client (an empty chunk: clients and
    benchmarks can time it); part of a character waits for the rest."""
    import asyncio

    from colibri.engine.request import TokenEvent
    from colibri.server.relay import Relay

    class Tok:
        table = {1: b"a", 2: b"", 3: b"\xc3", 4: b"\xa9"}

        def decode(self, ids):
            return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")

    async def run():
        r = Relay(Tok(), [])
        r.handle = type("Done", (), {"done": True})()
        for t in (1, 2, 3, 4, 1):
            r.queue.put_nowait(TokenEvent(t, None, None))
        r.queue.put_nowait(None)
        return [p.text async for p in r.pieces()]

    assert asyncio.run(run()) == ["a", "", "\u00e9", "a"]
