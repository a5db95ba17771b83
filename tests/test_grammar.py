"""Structured output: every token keeps the text inside the grammar, and each greedy token is the
model's most likely one among those the grammar allows (the exact logits, masked)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import colibri
from colibri.engine.grammar import json_grammar, lark_grammar, regex_grammar
from colibri.errors import ColibriError

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(ckpt):
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=128, threads=2, slots=2) as e:
        yield e


def prompt(llm) -> list[int]:
    return llm.tokenizer.encode("Once upon a time")


def test_json_schema_output_follows_the_schema(llm):
    h = llm.submit(prompt(llm), 64, grammar=json_grammar(SCHEMA))
    text = llm.tokenizer.decode(h.wait())
    assert h.finish_reason == "stop", text
    obj = json.loads(text)
    assert set(obj) == {"color", "n"} and obj["color"] in SCHEMA["properties"]["color"]["enum"]
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99


def test_greedy_tokens_are_the_best_the_grammar_allows(llm):
    """Replays the request: at every step the token is the argmax of the model's own logits (teacher
    forced, no grammar) over the tokens a fresh matcher allows there."""
    g = json_grammar(SCHEMA)
    p = prompt(llm)
    out = llm.submit(p, 64, grammar=g).wait()
    free = llm.submit(p, len(out)).wait()
    assert free != out  # the grammar changed the text
    c = llm._grammars.constraint(g, frozenset(llm.tokenizer.eos_ids))
    logits = llm.logits(p + out[:-1])[len(p) - 1:]  # [len(out), V]: row i predicts out[i]
    eos = sorted(llm.tokenizer.eos_ids)
    for i, tok in enumerate(out + eos[:1]):  # the last step: the text is complete, only an end token fits
        masked = c.mask(llm.logits(p + out)[-1] if i == len(out) else logits[i])
        assert int(torch.argmax(masked)) == tok, i
        allowed = torch.isfinite(masked)
        assert 0 < int(allowed.sum()) < masked.shape[0]
        c.accept(tok)


def test_json_object_regex_and_lark(llm):
    short = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"],
             "additionalProperties": False}
    h = llm.submit(prompt(llm), 64, grammar=json_grammar(short), temperature=0.9, seed=5)
    obj = json.loads(llm.tokenizer.decode(h.wait()))
    assert list(obj) == ["a"] and len(obj["a"]) <= 8 and h.finish_reason == "stop"
    # Any JSON object: a random model fills a key forever (max_tokens cuts it); the demo model closes it.
    from colibri.demo import demo_model

    with colibri.load(demo_model(), ctx_size=128, threads=2) as demo:
        h = demo.submit(demo.tokenizer.encode("Once upon a time"), 64, grammar=json_grammar())
        assert isinstance(json.loads(demo.tokenizer.decode(h.wait())), dict) and h.finish_reason == "stop"
    h = llm.submit(prompt(llm), 32, grammar=regex_grammar(r"[a-z]{1,6} [0-9]{2}"))
    assert re.fullmatch(r"[a-z]{1,6} [0-9]{2}", llm.tokenizer.decode(h.wait())) and h.finish_reason == "stop"
    h = llm.submit(prompt(llm), 32, grammar=lark_grammar('start: ("yes" | "no") "!"'), temperature=1.0, seed=1)
    assert llm.tokenizer.decode(h.wait()) in ("yes!", "no!")


def test_ignore_eos_goes_on_after_the_grammar_ends(llm):
    ids = llm.submit(prompt(llm), 12, grammar=regex_grammar("ab"), ignore_eos=True).wait()
    assert len(ids) == 12
    end = next(i for i, t in enumerate(ids) if t in llm.tokenizer.eos_ids)
    assert llm.tokenizer.decode(ids[:end]) == "ab"


def test_bad_grammars_are_refused(llm):
    with pytest.raises(ColibriError, match="bad grammar"):
        llm.submit(prompt(llm), 4, grammar=json_grammar({"type": "nonsense"}))
    with pytest.raises(ColibriError, match="grammar must be a string"):
        llm.submit(prompt(llm), 4, grammar={"type": "object"})
    with pytest.raises(ColibriError, match="JSON schema must be a JSON object"):
        json_grammar(["not", "a", "schema"])
