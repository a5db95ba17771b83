"""Chat templates (sandboxed, with transformers' helpers), their conversion, and the `colibri chat` REPL."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from hf_tiny import make_tokenizer_files
from tokenizers import Tokenizer as HFTok

import colibri
from colibri.chat_template import ChatTemplate, pick_template, read_templates
from colibri.errors import ColibriError

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """The tiny tokenizer plus ChatML's two special tokens."""
    folder = make_tokenizer_files(tmp_path_factory.mktemp("tok"))
    tk = HFTok.from_file(str(folder / "tokenizer.json"))
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tk


def test_chatml_matches_transformers_and_stops_at_im_end(vocab, tmp_path):
    from transformers import PreTrainedTokenizerFast

    msgs = [{"role": "system", "content": "Be brief. Ünïcödé ✓"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    t = ChatTemplate(CHATML, {"eos_token": "</s>"}, vocab.token_to_id)
    hf = PreTrainedTokenizerFast(tokenizer_object=vocab, eos_token="</s>")
    assert t.render(msgs) == hf.apply_chat_template(msgs, chat_template=CHATML, tokenize=False,
                                                    add_generation_prompt=True)
    assert t.render(msgs, add_generation_prompt=False).endswith("Again<|im_end|>\n")
    assert t.stop_ids == {vocab.token_to_id("<|im_end|>")}
    # a token the vocabulary lacks, or one the template does not write, is no stop token
    assert ChatTemplate(CHATML, {}, make_plain_vocab().token_to_id).stop_ids == frozenset()
    assert ChatTemplate("{{ messages[0]['content'] }}", {}, vocab.token_to_id).stop_ids == frozenset()
    # through a special-token variable: eos_token = <|im_end|>
    t2 = ChatTemplate("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
                      {"eos_token": {"content": "<|im_end|>"}}, vocab.token_to_id)
    assert t2.stop_ids == {vocab.token_to_id("<|im_end|>")} and t2.render(msgs[1:2]) == "Hi<|im_end|>"


def make_plain_vocab():
    return HFTok.from_str(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0},
                                                                   "unk_token": "a"}}))


def test_transformers_helpers():
    src = ("{{ strftime_now('%Y') }}|{{ messages | tojson }}|{% set ns = namespace(n=0) %}"
           "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}"
           "{{ ns.n }}|{% generation %}gen{% endgeneration %}")
    out = ChatTemplate(src).render([{"role": "user", "content": "é<b>"}, {"role": "user", "content": "x"}])
    year, js, n, gen = out.split("|")
    assert year == str(datetime.now().year) and n == "1" and gen == "gen"
    assert json.loads(js)[0]["content"] == "é<b>" and "é<b>" in js  # no \u escapes, no HTML escaping


def test_template_errors_are_one_line():
    with pytest.raises(ColibriError, match="chat template is broken") as e:
        ChatTemplate("{% for m in messages %}{{ m.content }")
    assert "\n" not in str(e.value)
    alternate = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}{% endfor %}")
    with pytest.raises(ColibriError, match="roles must alternate"):
        ChatTemplate(alternate).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ColibriError, match="template failed"):  # the sandbox refuses internals
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])
    with pytest.raises(ColibriError, match="template failed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


def test_named_templates():
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    assert pick_template(named) == "D" and pick_template(named, "tool_use") == "T"
    with pytest.raises(ColibriError, match="no chat template named 'rag'.*default, tool_use"):
        pick_template(named, "rag")
    assert pick_template("S") == "S" and pick_template(None) is None


def test_converter_embeds_chat_template_jinja(ckpt, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(ckpt.hf("olmoe"), hf)
    (hf / "chat_template.jinja").write_text("J{% for m in messages %}[{{ m.content }}]{% endfor %}")
    (hf / "additional_chat_templates").mkdir()
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS")
    from colibri.convert.converter import convert

    llm = colibri.load(convert(hf, tmp_path / "m.coli", "f32", 32, progress=False), ctx_size=64)
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "J[hi]"  # over the config's
    assert llm.tokenizer.template("tool_use").render([]) == "TOOLS"
    llm.close()
    # tokenizer_config.json's named list, without any .jinja file
    cfg = {"chat_template": [{"name": "default", "template": "A"}, {"name": "rag", "template": "B"}]}
    assert read_templates(tmp_path / "nowhere", cfg) == cfg["chat_template"]
    assert read_templates(tmp_path / "nowhere", {}) is None


def chat(model: Path, stdin: str, *args: str, ignore_eos: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "colibri", "chat", "--model", str(model), "--temp", "0",
                           "--threads", "1", "--ctx-size", "256", "-n", "8", *(["--ignore-eos"] * ignore_eos), *args],
                          input=stdin, capture_output=True, text=True, env=env, timeout=120)


def test_repl_through_a_pipe_keeps_history(ckpt):
    model = ckpt.coli("mixtral", "f32")
    r = chat(model, "Hello there\nOnce upon a time\n/reset\n\nOnce upon a time\n/system Be kind.\nHi\n/exit\nignored\n")
    assert r.returncode == 0, r.stderr
    llm = colibri.load(model, ctx_size=256)

    def answer(msgs):
        prompt = llm.tokenizer.apply_chat_template(msgs)
        return "".join(llm.generate(prompt, 8, temperature=0, ignore_eos=True, add_special_tokens=False))

    a1 = answer([{"role": "user", "content": "Hello there"}])
    a2 = answer([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": a1},
                 {"role": "user", "content": "Once upon a time"}])
    a3 = answer([{"role": "user", "content": "Once upon a time"}])  # after /reset: no history
    a4 = answer([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}])
    llm.close()
    assert a2 != a3
    assert r.stdout == f"{a1}\n{a2}\n{a3}\n{a4}\n"  # /exit stops before "ignored"


def test_repl_prompt_cache_serves_the_next_session(ckpt, tmp_path):
    """`--prompt-cache FILE`: the conversation's K/V is saved after each answer; the next session loads it,
    and its first turn (the same system message and question) computes only what is new -- same answers."""
    import re

    model, cache = ckpt.coli("mixtral", "f32"), tmp_path / "chat.kv"
    args = ("--system", "Be kind.", "--prompt-cache", str(cache), "--stats", "--log-level", "info")
    first = chat(model, "Hello there\nOnce upon a time\n", *args)
    assert first.returncode == 0, first.stderr
    saved = [int(n) for n in re.findall(r"(\d+) positions saved", first.stderr)]
    assert len(saved) == 2 and saved[1] > saved[0] > 0 and cache.exists()
    second = chat(model, "Hello there\n", *args)
    assert second.returncode == 0, second.stderr
    assert f"{saved[1]} positions loaded" in second.stderr
    assert second.stdout.splitlines()[0] == first.stdout.splitlines()[0]
    prompt, cached = map(int, re.search(r"prompt (\d+) tok \((\d+) cached\)", second.stderr).groups())
    assert 0 < cached < prompt  # the first turn's prompt came from the file, up to its new tokens
    bad = chat(model, "Hi\n", "--prompt-cache", str(tmp_path), "--no-cache-prompt")
    assert bad.returncode != 0 and "--prompt-cache needs prompt caching" in bad.stderr


def test_repl_shows_reasoning_on_stderr_and_keeps_the_answer_only(ckpt):
    """A thinking model's <think> block (forced here by a grammar) goes to stderr; stdout and the next
    turn's history get the answer."""
    pytest.importorskip("llguidance")
    r = chat(ckpt.coli("mixtral", "f32"), "Hi\nAgain\n", "-n", "40",
             "--grammar", 'root ::= "<think>\\nPonder.\\n</think>\\n\\n" ("Yes." | "No.")', ignore_eos=False)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.splitlines()
    assert len(answers) == 2 and all(a in ("Yes.", "No.") for a in answers), r.stdout
    assert r.stderr.count("Ponder.") == 2 and "<think>" not in r.stdout + r.stderr


def test_engine_chat_answers_as_transformers_does(ckpt):
    from hf_tiny import hf_greedy, load_hf
    from transformers import AutoTokenizer

    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there"}]
    tok = AutoTokenizer.from_pretrained(ckpt.hf("mixtral"))
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = tok.decode(hf_greedy(load_hf(ckpt.hf("mixtral")), ids, 8), skip_special_tokens=True)
    with colibri.load(ckpt.coli("mixtral", "f32"), ctx_size=256) as llm:
        assert "".join(llm.chat(msgs, 8, temperature=0, ignore_eos=True)) == want
        assert llm.last_stats.prompt_tokens == len(ids)


def test_engine_chat_yields_the_answer_and_keeps_reasoning_and_calls_apart(ckpt):
    """Engine.chat splits a thinking model's reasoning and the tool calls it writes (here forced by
    grammars, in the Hermes format the template-less detection assumes) into last_message."""
    pytest.importorskip("llguidance")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    from colibri.engine.grammar import gbnf_grammar

    with colibri.load(ckpt.coli("mixtral", "f32"), ctx_size=256) as llm:
        think = gbnf_grammar('root ::= "<think>\\nRome it is.\\n</think>\\n\\n" ("Sunny." | "Rainy.")')
        answer = "".join(llm.chat(msgs, 60, temperature=0, grammar=think))
        m = llm.last_message
        assert answer in ("Sunny.", "Rainy.") and m["content"] == answer
        assert m["reasoning_content"] == "Rome it is." and m["tool_calls"] is None
        call = gbnf_grammar('root ::= "Let me look. <tool_call>{\\"name\\": \\"get_weather\\", '
                            '\\"arguments\\": {\\"city\\": \\"Rome\\"}}</tool_call>"')
        answer = "".join(llm.chat(msgs, 80, tools=[tool], temperature=0, grammar=call))
        m = llm.last_message
        assert answer.strip() == "Let me look." == m["content"] and m["reasoning_content"] is None
        (tc,) = m["tool_calls"]
        assert tc["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_repl_without_template_is_one_line_error(ckpt, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(ckpt.hf("mixtral"), hf)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if %}"
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    from colibri.convert.converter import convert

    r = chat(convert(hf, tmp_path / "m.coli", "f32", 32, progress=False), "Hi\n")
    assert r.returncode == 1 and r.stderr.startswith("colibri: error: the model's chat template is broken")
    assert r.stderr.count("\n") == 1
