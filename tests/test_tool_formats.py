"""Tool calls and reasoning in each model family's own format (server/tool_formats.py, server/harmony.py,
server/answer.py): whole answers and the same answers streamed in pieces of every size, format detection
from templates, the special tokens the parsers need kept in decoded text, and gpt-oss's end tokens."""

from __future__ import annotations

import json

import pytest

from colibri.server.answer import splitter, whole
from colibri.server.harmony import HarmonySplit
from colibri.server.tool_formats import FORMATS, HARMONY, CallStream, detect

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "code": {"type": "string"}}}}
ARGS = {"city": "Rome", "days": 2, "code": "007"}

# (format, an answer saying "Let me check." then calling get_weather(ARGS) in that format)
CALLS = [
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, '
               '"code": "007"}}\n</tool_call>'),
    ("glm45", "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n"
              "</tool_call>"),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n<parameter=code>\n007\n</parameter>\n</function>\n</tool_call>"),
    ("mistral", 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, '
                '"code": "007"}}]'),
    ("mistral", 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2, "code": "007"}'),
    ("deepseek", "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Rome", "days": 2, "code": "007"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", 'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome", '
                 '"days": 2, "code": "007"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("minimax_m2", 'Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Rome'
                   '</parameter>\n<parameter name="days">2</parameter>\n<parameter name="code">007</parameter>\n'
                   "</invoke>\n</minimax:tool_call>"),
    ("kimi_k2", "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Rome", "days": 2, "code": "007"}<|tool_call_end|>'
                "<|tool_calls_section_end|>"),
    ("pythonic", 'Let me check. [get_weather(city="Rome", days=2, code="007")]'),
    ("hunyuan", 'Let me check.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, '
                '"code": "007"}}]</tool_calls>'),
    ("granite", 'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, '
                '"code": "007"}}]'),
    ("granite", 'Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, '
                '"code": "007"}}]'),
    ("lfm2", 'Let me check.<|tool_call_start|>[get_weather(city="Rome", days=2, code="007")]<|tool_call_end|>'),
    ("gemma4", 'Let me check.<|tool_call>call:get_weather{city:<|"|>Rome<|"|>,days:2,code:<|"|>007<|"|>}<tool_call|>'),
    (HARMONY, "<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "days": 2, "code": "007"}'),
]


def _streamed(fmt: str, text: str, size: int) -> tuple[str, str, list[dict]]:
    s = splitter(fmt, TOOLS, True, False, True)
    parts = [s.push(text[i:i + size]) for i in range(0, len(text), size)]
    r, c, calls = s.finish()
    return "".join(p[0] for p in parts) + r, "".join(p[1] for p in parts) + c, calls


@pytest.mark.parametrize("fmt,text", CALLS)
def test_each_format_gives_the_call_and_the_text_streamed_or_whole(fmt, text):
    reasoning, content, calls = whole(splitter(fmt, TOOLS, True, False, True), text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS  # (GLM: "007" stays a string, 2 a number)
    said = reasoning if fmt == HARMONY else content
    assert said == "Let me check." and (content is None if fmt == HARMONY else not reasoning)
    for size in (1, 2, 5, 13):
        r, c, streamed = _streamed(fmt, text, size)
        assert (r, c.strip() or None) == (reasoning, content), size
        assert [x["function"] for x in streamed] == [x["function"] for x in calls], size


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_calls_of_unknown_tools_or_broken_arguments_stay_text(fmt):
    text = dict(CALLS)[fmt].replace("get_weather", "launch_rocket")
    assert FORMATS[fmt].parse(text, TOOLS) == (text, [])
    broken = dict(CALLS)[fmt].replace('"Rome"', '"Rome').replace("</function>", "</func>") \
        .replace("</invoke>", "</in").replace('<|"|>Rome<|"|>', '<|"|>Rome')
    if fmt != "glm45":  # (GLM's values are text: a broken one is just odd text, and its call still parses)
        assert FORMATS[fmt].parse(broken, TOOLS) == (broken, [])
    assert FORMATS[fmt].parse("no calls here", TOOLS) == ("no calls here", [])


def test_qwen3_coder_values_take_their_parameters_types():
    """A Qwen3-Coder value is text between newlines: a string parameter keeps it as written (inner lines and
    all), a typed one gets its JSON (or Python literal); a call without its <tool_call> wrapper counts."""
    tools = {"write": {"type": "object", "properties": {"path": {"type": "string"}, "body": {"type": "string"},
                                                        "mode": {"type": "integer"}, "opts": {"type": "object"}}}}
    text = ("<function=write>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=body>\n\nx = 1\n  y\n\n"
            "</parameter>\n<parameter=mode>\n420\n</parameter>\n<parameter=opts>\n{\"force\": true}\n</parameter>\n"
            "</function>\n<function=write>\n<parameter=path>\nb\n</parameter>\n<parameter=opts>\n{'force': True}\n"
            "</parameter>\n<parameter=mode>\nseven\n</parameter>\n"
            "</function>\nDone.")
    content, calls = FORMATS["qwen3_coder"].parse(text, tools)
    assert content == "Done." and len(calls) == 2
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "/tmp/a.py", "body": "\nx = 1\n  y\n",
                                                             "mode": 420, "opts": {"force": True}}
    # (an object as the template writes one back, a Python literal; an integer that is neither stays text)
    assert json.loads(calls[1]["function"]["arguments"]) == {"path": "b", "opts": {"force": True}, "mode": "seven"}


def test_a_stream_holds_back_only_what_may_open_a_call():
    fmt = FORMATS["hermes"]
    text = 'a < b, <tool; then <tool_call>{"name": "get_weather", "arguments": {"days": 1}}</tool_call> done'
    for size in (1, 2, 3, 7):
        s = CallStream(fmt, TOOLS)
        sent = "".join(s.push(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = s.finish()
        assert sent == "a < b, <tool; then " and rest == "done" and calls[0]["function"]["name"] == "get_weather"
    s = CallStream(fmt, TOOLS)
    assert s.push("x <tool_") == "x " and s.finish() == ("<tool_", [])
    s = CallStream(FORMATS["mistral"], TOOLS)  # [ alone may open [TOOL_CALLS]; [1] may not
    assert s.push("see [1] and [TOOL") == "see [1] and " and s.finish() == ("[TOOL", [])


def test_pythonic_calls_are_parsed_never_evaluated():
    """Llama 4's form: several calls in one list, between <|python_start|> / <|python_end|> or not, JSON's words
    and nested literals as arguments; brackets in the text before stream on; anything that is not a literal
    (a call, a name) or a positional argument keeps the whole list as text."""
    fmt = FORMATS["pythonic"]
    tools = {**TOOLS, "now": {"type": "object", "properties": {}}}
    text = '<|python_start|>[get_weather(city=\'Rome\', days=2, code="007"), now()]<|python_end|>'
    content, calls = fmt.parse(text, tools)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS and calls[1]["function"]["arguments"] == "{}"
    content, calls = fmt.parse('See [1] and [the docs](x). [get_weather(city="A", days=true, code=null)]', tools)
    assert content == "See [1] and [the docs](x)." and json.loads(calls[0]["function"]["arguments"]) == \
        {"city": "A", "days": True, "code": None}
    for bad in ('[get_weather(city=__import__("os").system("x"))]', '[get_weather("Rome")]', "[get_weather(city=x)]",
                "[get_weather(**kw)]", "[]"):
        assert fmt.parse(bad, tools) == (bad, []), bad
    for size in (1, 2, 3, 7):
        s = CallStream(fmt, tools)
        line = 'See [1] and [the docs](x). [now()]'
        sent = "".join(s.push(line[i:i + size]) for i in range(0, len(line), size))
        rest, calls = s.finish()
        assert sent == "See [1] and [the docs](x). " and rest is None and calls[0]["function"]["name"] == "now"


def test_harmony_channels_split_reasoning_answer_and_plain_text():
    text = "<|channel|>analysis<|message|>Think <|it|> over.<|end|><|start|>assistant<|channel|>final<|message|>Hi <b>!"
    for size in (1, 3, len(text)):
        s = HarmonySplit(TOOLS)
        parts = [s.push(text[i:i + size]) for i in range(0, len(text), size)]
        r, c, calls = s.finish()
        assert ("".join(p[0] for p in parts) + r, "".join(p[1] for p in parts) + c, calls) == \
            ("Think <|it|> over.", "Hi <b>!", []), size
    assert whole(HarmonySplit(TOOLS), '{"a": 1}') == ("", '{"a": 1}', [])  # a JSON grammar's answer: no header
    assert whole(HarmonySplit(TOOLS, reasoning=False), text)[:2] == ("", "Think <|it|> over.Hi <b>!")
    unknown = dict(CALLS)[HARMONY].replace("get_weather", "launch_rocket")
    r, c, calls = whole(HarmonySplit(TOOLS), unknown)
    assert r == "Let me check." and calls == [] and json.loads(c) == ARGS  # (no such tool: its text is content)


def test_the_format_is_detected_from_the_template():
    assert detect("{{ '<|start|>' + m.role + '<|channel|>final<|message|>' }}") == HARMONY
    assert detect("<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>") == "deepseek"
    assert detect("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert detect("<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>") == "kimi_k2"
    assert detect('<minimax:tool_call>\n<invoke name="{{ tc.name }}">') == "minimax_m2"
    assert detect("<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>") == "qwen3_coder"
    assert detect("{{- '<|python_start|>' }}") == detect("format of [func_name1(params_name1=params_value1)]") \
        == "pythonic"
    assert detect("<tool_calls>{{ tool_calls | tojson }}</tool_calls>") == "hunyuan"
    assert detect("{{- '<|tool_call|>' + message.tool_calls | tojson }}") == "granite"
    assert detect("{{- '<|tool_call>call:' + function['name'] + '{' -}}") == "gemma4"
    assert detect("List of tools: <|tool_list_start|>[...]<|tool_list_end|> ... <|tool_call_start|>") == "lfm2"
    assert detect("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>") == detect("{{ m.content }}") == "hermes"


def _tokenizer(specials: list[str]):
    """A colibri Tokenizer over a word-level vocabulary with these special tokens."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    from colibri.tokenizer import Tokenizer

    words = ["hello", "world", "{", "}"]
    tk = HF(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="hello"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(specials)
    return Tokenizer({"json": tk.to_str()})


def test_special_markers_the_parsers_read_are_kept_in_decoded_text():
    from colibri.server.answer import keep_ids
    from colibri.tokenizer import StreamDecoder

    tok = _tokenizer(["<|channel|>", "<|message|>", "<|end|>", "<|endoftext|>"])
    ids = tok.encode("<|channel|> hello <|message|> world <|endoftext|>", add_special_tokens=False)
    keep = keep_ids(tok, HARMONY)
    assert {tok.tk.id_to_token(i) for i in keep} == {"<|channel|>", "<|message|>", "<|end|>"}
    assert tok.decode(ids) == "hello world"  # special tokens skipped, as ever
    assert tok.decode(ids, keep=keep) == "<|channel|>hello<|message|>world"
    dec = StreamDecoder(tok, keep)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids, keep=keep)
    assert keep_ids(tok, "hermes") == frozenset()  # (its markers are not in this vocabulary)


def test_gpt_oss_turns_end_at_return_or_call_not_at_each_messages_end():
    from colibri.chat_template import ChatTemplate

    vocab = {"<|end|>": 1, "<|return|>": 2, "<|call|>": 3}
    harmony = ChatTemplate("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}"
                           "<|end|>{% endfor %}{# <|return|> <|call|> #}", {}, vocab.get)
    assert harmony.stop_ids == {2, 3}
    other = ChatTemplate("{% for m in messages %}{{ m.content }}<|end|>{% endfor %}", {}, vocab.get)
    assert other.stop_ids == {1}


def test_mistral_call_ids_are_the_nine_characters_its_templates_require():
    """Mistral's chat templates refuse tool call ids that are not 9 letters and digits: its calls get such ids
    (the model's own [CALL_ID] kept), parsed or forced; other formats keep OpenAI's `call_` ids."""
    import re

    from colibri.server.tool_stream import ForcedCallStream

    nine = re.compile(r"[A-Za-z0-9]{9}")
    for text in [t for f, t in CALLS if f == "mistral"]:
        assert nine.fullmatch(FORMATS["mistral"].parse(text, TOOLS)[1][0]["id"])
    own = 'x [TOOL_CALLS]get_weather[CALL_ID]Ab3De6Gh9[ARGS]{"city": "Rome"}'
    assert FORMATS["mistral"].parse(own, TOOLS)[1][0]["id"] == "Ab3De6Gh9"
    for named in (None, "get_weather"):
        s = ForcedCallStream(named, "mistral")
        s.push('[{"name": "get_weather", "arguments": {}}]' if named is None else "{}")
        assert nine.fullmatch(s.finish()[2][0]["id"])
    assert FORMATS["hermes"].parse(dict(CALLS)["hermes"], TOOLS)[1][0]["id"].startswith("call_")
    s = ForcedCallStream("get_weather")
    s.push("{}")
    assert s.finish()[2][0]["id"].startswith("call_")


def test_a_forced_call_streams_its_name_then_its_arguments():
    """tool_choice required / named (server/tool_stream.py): deltas in pieces of any size add up to the
    calls; an item's arguments written before its name wait for it; a cut answer gives no complete call."""
    from colibri.server.tool_stream import ForcedCallStream

    text = ('[{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "n": [1, {"x": "}"}]}}, '
            '{"arguments": {"zone": "UTC"}, "name": "get_time"}]')
    for size in (1, 2, 3, 7, len(text)):
        s = ForcedCallStream(None)
        deltas = []
        for i in range(0, len(text), size):
            assert s.push(text[i:i + size]) == ("", "")
            deltas += s.take()
        calls = s.finish()[2]
        got: dict[int, dict] = {}
        for d in deltas:
            g = got.setdefault(d["index"], {"id": d.get("id"), "name": d["function"].get("name"), "arguments": ""})
            g["arguments"] += d["function"].get("arguments", "")
        assert [g["name"] for g in got.values()] == ["get_weather", "get_time"], size
        assert [json.loads(g["arguments"]) for g in got.values()] == [json.loads(x["function"]["arguments"])
                                                                      for x in calls], size
        assert [g["id"] for g in got.values()] == [x["id"] for x in calls] and not got[0]["arguments"][0].isspace()
    s = ForcedCallStream("get_weather")
    s.push('{"city": ')
    s.push('"Rome"}')
    deltas = s.take()
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"].get("arguments", "") for d in deltas) == '{"city": "Rome"}'
    assert s.finish()[2][0]["function"]["arguments"] == '{"city": "Rome"}'
    cut = ForcedCallStream(None)
    cut.push('[{"name": "get_time", "arguments": {"zo')
    assert cut.finish()[2] == [] and cut.take()[0]["function"]["name"] == "get_time"


def test_kimi_call_ids_are_the_functions_name_index_its_template_writes_back():
    """Kimi-K2's template writes a call's id back as is and its tool results as "## Return of ID": the id the
    model wrote (`functions.NAME:IDX`) is kept; forced calls get that form (their place in the answer)."""
    from colibri.server.tool_stream import ForcedCallStream

    two = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>"
           '{"city": "Rome"}<|tool_call_end|><|tool_call_begin|> get_weather <|tool_call_argument_begin|>{}'
           "<|tool_call_end|><|tool_calls_section_end|>")
    content, calls = FORMATS["kimi_k2"].parse(two, TOOLS)
    assert content is None and [c["id"] for c in calls] == ["functions.get_weather:3", "functions.get_weather:1"]
    s = ForcedCallStream(None, "kimi_k2")
    s.push('[{"name": "get_weather", "arguments": {}}, {"arguments": {"city": "Oslo"}, "name": "get_weather"}]')
    assert [c["id"] for c in s.finish()[2]] == ["functions.get_weather:0", "functions.get_weather:1"]
    named = ForcedCallStream("get_weather", "kimi_k2")
    named.push("{}")
    assert named.take()[0]["id"] == named.finish()[2][0]["id"] == "functions.get_weather:0"


def test_a_kimi_call_opened_inside_the_reasoning_ends_it():
    """Kimi-K2-Thinking may open its calls section before any </think>: the reasoning ends there and the
    call is parsed, whole or streamed; formats whose models close </think> first keep such text reasoning."""
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
    text = "<think>The user wants the weather. " + call
    reasoning, content, calls = whole(splitter("kimi_k2", TOOLS, True, False, True), text)
    assert (reasoning, content) == ("The user wants the weather.", None)
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in calls] == [("functions.get_weather:0",
                                                                                  {"city": "Rome"})]
    for size in (1, 3, 7):
        s = splitter("kimi_k2", TOOLS, True, False, True)
        parts = [s.push(text[i:i + size]) for i in range(0, len(text), size)]
        r, c, streamed = s.finish()
        assert "".join(p[0] for p in parts) + r == reasoning and not ("".join(p[1] for p in parts) + c).strip()
        assert [x["function"] for x in streamed] == [x["function"] for x in calls], size
    closed = "<think>Weather. </think>It is sunny."  # (and without tools nothing ends the reasoning early)
    assert whole(splitter("kimi_k2", TOOLS, True, False, True), closed) == ("Weather.", "It is sunny.", [])
    assert whole(splitter("kimi_k2", None, True, False, True), text)[0].startswith("The user wants the weather. <|")
    hermes = '<think>I could write <tool_call>{"name": "get_weather"}</tool_call> here</think>Done.'
    assert whole(splitter("hermes", TOOLS, True, False, True), hermes)[:2] == (
        'I could write <tool_call>{"name": "get_weather"}</tool_call> here', "Done.")


def test_a_hunyuan_block_is_cut_out_only_when_every_call_in_it_is_known():
    """Hunyuan-A13B lists several calls in one block: all of them go out, in order; a block with a call of an
    unknown tool stays text whole."""
    fmt = FORMATS["hunyuan"]
    two = ('<tool_calls>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_calls>')
    content, calls = fmt.parse("Checking both.\n" + two, TOOLS)
    assert content == "Checking both." and [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"city": "Rome"}, {"city": "Oslo"}]
    mixed = two.replace('"Oslo"}}', '"Oslo"}}, {"name": "launch_rocket", "arguments": {}}')
    assert fmt.parse(mixed, TOOLS) == (mixed, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hunyuan_answer_tags_leave_the_content_streamed_or_whole(size):
    """Hunyuan-A13B: <think> reasoning </think> then <answer> ... </answer>: the reasoning goes apart, the tags
    go, the calls come out; an answer without tags, or a lone "<" in it, passes unchanged."""
    call_text = '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_calls>'
    cases = [("<think>\nI should greet.\n</think>\n<answer>\nHello <b>world</b>, a < b.\n</answer>", None,
              ("I should greet.", "Hello <b>world</b>, a < b.", [])),
             ("<think>\nWeather.\n</think>\n<answer>\nLet me check.\n" + call_text + "\n</answer>", TOOLS,
              ("Weather.", "Let me check.", ["get_weather"])),
             ("No tags at all, </ans", None, ("", "No tags at all, </ans", []))]
    def run(pieces: list[str], tools: dict | None):
        s = splitter("hunyuan", tools, True, False, True, answer_tags=True)
        out = [s.push(p) for p in pieces]
        r, c, calls = s.finish()
        return "".join(o[0] for o in out) + r, "".join(o[1] for o in out) + c, calls

    for text, tools, (want_r, want_c, want_calls) in cases:
        r, c, calls = run([text[i:i + size] for i in range(0, len(text), size)], tools)
        assert (r, c.strip(), [x["function"]["name"] for x in calls]) == (want_r, want_c, want_calls), text


def test_gemma4_arguments_nest_keep_strings_verbatim_and_read_bare_words():
    from colibri.server.gemma4_calls import arguments

    body = ('{place:{city:<|"|>Rome, "IT"<|"|>,zip:<|"|>00100<|"|>},days:[1,2.5,-3],flags:[true,null],'
            '<|"|>odd key<|"|>:x1, empty:{}, none:[]}')
    assert arguments(body) == {"place": {"city": 'Rome, "IT"', "zip": "00100"}, "days": [1, 2.5, -3],
                               "flags": [True, None], "odd key": "x1", "empty": {}, "none": []}
    for bad in ('{city:<|"|>Rome}', "{city Rome}", "{a:1,", "{a:1}}", "[1,2]", "{a:1 b:2}"):
        assert arguments(bad) is None, bad
    text = ('<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|> and '
            '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>')
    content, calls = FORMATS["gemma4"].parse(text, TOOLS)
    assert content == "and"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}, {"city": "Oslo", "days": 3}]


@pytest.mark.parametrize("size", [0, 1, 3, 7])
def test_gemma4_reasoning_is_its_thought_channel(size):
    from colibri.server.answer import keep_ids

    text = ('<|channel>thought\nThe user wants weather.<channel|>Let me check.'
            '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>')
    r, c, calls = whole(splitter("gemma4", TOOLS, True, False, True), text) if not size else _streamed("gemma4", text,
                                                                                                       size)
    assert (r, c.strip()) == ("The user wants weather.", "Let me check.")
    assert [json.loads(x["function"]["arguments"]) for x in calls] == [{"city": "Rome"}]
    assert whole(splitter("hermes", None, True, False, True), text)[0] == ""  # (only Gemma's format reads the channel)
    tok = _tokenizer(["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<turn|>"])
    assert {tok.tk.id_to_token(i) for i in keep_ids(tok, "gemma4")} \
        == {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'}


def test_lfm2_calls_may_come_before_the_text():
    text = 'Checking.<|tool_call_start|>[get_weather(city="Rome"), get_weather(city="Oslo")]<|tool_call_end|>Done.'
    content, calls = FORMATS["lfm2"].parse(text, TOOLS)
    assert content == "Checking.Done."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}, {"city": "Oslo"}]
    mixed = text.replace('get_weather(city="Oslo")', 'launch_rocket(city="Oslo")')  # one unknown call: all stay text
    assert FORMATS["lfm2"].parse(mixed, TOOLS) == (mixed, [])
