"""`colibri serve` with a linear-attention model (Qwen3-Next): chat turns keep transformers' answers with prompt
caching off (nothing cached), and a slot save is refused with a 400 that says why."""

from __future__ import annotations

import shutil

import pytest
from chat_server import MESSAGES, TEMPLATE
from hf_tiny import hf_greedy
from serve_proc import Server
from transformers import AutoTokenizer

from colibri.convert.converter import convert


@pytest.fixture(scope="module")
def linear_server(ckpt, tmp_path_factory):
    hf = tmp_path_factory.mktemp("next") / "hf"
    shutil.copytree(ckpt.hf("qwen3_next"), hf)
    (hf / "chat_template.jinja").write_text(TEMPLATE)
    coli = convert(hf, hf.parent / "m.coli", "f32", 32, progress=False)
    s = Server(coli, "--slots", "1", "--ctx-size", "128", "--slot-save-path", str(tmp_path_factory.mktemp("slots")))
    yield s, hf
    err = s.stop()
    assert s.proc.returncode == 0, err


def test_chat_turns_run_without_prompt_caching(linear_server) -> None:
    from hf_tiny import load_hf

    server, hf = linear_server
    tok, model = AutoTokenizer.from_pretrained(hf), load_hf(hf)
    for _ in range(2):  # the same conversation twice: the second finds nothing cached either
        status, r = server.request("POST", "/v1/chat/completions", {
            "model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert status == 200, r
        ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r["choices"][0]["message"]["content"] == tok.decode(hf_greedy(model, ids, 8), skip_special_tokens=True)
        assert r["usage"]["prompt_tokens"] == len(ids)
        assert (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def test_a_slot_save_is_refused_with_the_reason(linear_server) -> None:
    server, _ = linear_server
    status, r = server.request("POST", "/slots/0?action=save", {"filename": "s.bin"})
    assert status == 400 and "linear-attention" in r["error"]["message"], r
