"""`colibri serve` as a real process on a free local port: the official openai client (chat and
completions, streamed and not), raw HTTP for errors, and exactness against transformers."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from chat_server import AUTH, CHAT, MESSAGES
from hf_tiny import hf_greedy, hf_logits
from serve_proc import Server

from colibri.engine.kv import common_prefix

openai = pytest.importorskip("openai")


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
    body = {"prompt": question, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
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
    conn, _ = _open_stream(server.port, {"prompt": "Once", "max_tokens": 100, "ignore_eos": True}, AUTH)
    (busy,) = [s for s in server.request("GET", "/slots", None, AUTH)[1] if s["busy"]]
    assert busy["request_id"]
    status, r = server.request("POST", f"/slots/{busy['id']}?action=erase", None, AUTH)
    assert status == 409 and r["error"]["code"] == "slot_busy"
    conn.close()  # (the server cancels the request)



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



def _open_stream(port: int, body: dict, headers: dict | None = None
                 ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json", **(headers or {})})
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
