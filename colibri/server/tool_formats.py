"""How models write tool calls in their text, per family, for tool_choice "auto".

Each format is detected from the chat template that teaches it (`detect`), or named with
`colibri serve --tool-parser`:
- `hermes` (Qwen2/Qwen3-MoE, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `glm45` (GLM-4.5 / 4.6 / 4.7): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`,
  a value being raw text for a string parameter and JSON otherwise;
- `mistral` (Mixtral / Mistral instruct): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the
  newer `[TOOL_CALLS]NAME[ARGS]{...}` per call;
- `qwen3_coder` (Qwen3-Coder, a Qwen3-MoE): `<tool_call><function=NAME><parameter=K>V</parameter>...
  </function></tool_call>`, each value on lines of its own, raw text for a string parameter and JSON
  (or a Python literal, as its template writes an object back) otherwise;
- `deepseek` (DeepSeek-V3 / R1 / V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
  then the arguments in a ```json block (V3), or `...begin｜>NAME<｜tool▁sep｜>{...}` (V3.1), each call closed
  by `<｜tool▁call▁end｜>`;
- `minimax_m2` (MiniMax-M2): `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>...
  </invoke></minimax:tool_call>`, a value raw text for a string parameter and JSON otherwise (as glm45);
- `kimi_k2` (Kimi-K2, a DeepSeek-V3): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX`
  `<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`, the call's id being
  `functions.NAME:IDX` (its template writes the id back that way); Kimi-K2-Thinking may open the section
  inside its unclosed reasoning, which then ends there (`in_reasoning`, server/answer.py).
- `pythonic` (Llama 4, as vLLM's llama4_pythonic; Llama 3.2's form): a Python list of calls with keyword
  arguments ending the answer, `[get_weather(city="Rome", days=2), ...]`, optionally between
  `<|python_start|>` and `<|python_end|>`; the arguments Python (or JSON) literals, never evaluated.
- `hunyuan` (Hunyuan-A13B): a JSON list of `{"name": ..., "arguments": {...}}` between `<tool_calls>` and
  `</tool_calls>`.
- `granite` (IBM Granite 3.x): a JSON list of `{"name": ..., "arguments": {...}}` after `<|tool_call|>` (3.0's
  token) or `<tool_call>` (3.1's string), with no closing tag.
- `lfm2` (LFM2 / LFM2-MoE): pythonic's call list between `<|tool_call_start|>` and `<|tool_call_end|>`, text
  before or after it;
- `gemma4` (Gemma 4): `<|tool_call>call:NAME{key:value,...}<tool_call|>` per call, in its own object syntax
  (strings between `<|"|>` tokens; server/gemma4_calls.py).
(gpt-oss writes its calls in its channels: server/harmony.py.) A call naming no known tool, or whose
arguments do not parse, stays in the text, as does everything around the calls.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import gemma4_calls
from .reasoning import CLOSE, OPEN, held_tail


def new_call_id(fmt: str | None = None, name: str = "", index: int = 0) -> str:
    """A tool call's id: OpenAI's form; 9 letters and digits for `mistral` (Mistral's chat templates
    refuse a conversation whose tool call ids are anything else); `functions.NAME:INDEX` for `kimi_k2`
    (the form its template writes back, `index` the call's place in the answer)."""
    if fmt == "mistral":
        return uuid.uuid4().hex[:9]
    if fmt == "kimi_k2":
        return f"functions.{name}:{index}"
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    """One OpenAI tool call; `arguments` as the JSON text OpenAI sends."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


# A parser: (text, {tool name: its parameters schema}) -> (the calls found, (start, end) of each in the text).
Found = tuple[list[dict], list[tuple[int, int]]]


def _json_args(name: str, raw: str, tools: dict[str, dict], call_id: str | None = None) -> dict | None:
    """A call of a known tool whose arguments are a JSON object, else None."""
    if name not in tools:
        return None
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return None
    return call(name, args, call_id) if isinstance(args, dict) else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _hermes(text: str, tools: dict[str, dict]) -> Found:
    calls, spans = [], []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("name") in tools:
            calls.append(call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            spans.append(m.span())
    return calls, spans


_GLM = re.compile(r"<tool_call>\s*([^<\n]+?)\s*((?:<arg_key>.*?)?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _typed_value(raw: str, schema: dict) -> Any:
    """A parameter written as text: as is for a string parameter, else its JSON when it parses, else a
    Python literal (Qwen3-Coder's template writes an object argument with Jinja's `string`: `{'a': True}`),
    else the text."""
    if schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw  # (an untyped or mistyped value: the model's text)


def _unwrap_lines(v: str) -> str:
    """A value without the newline the template writes before it and the one after it."""
    return v.removeprefix("\n").removesuffix("\n")


def _tagged(call_re: re.Pattern, arg_re: re.Pattern, clean: Callable[[str], str]
            ) -> Callable[[str, dict[str, dict]], Found]:
    """A parser of calls written as a name then key / value tags (GLM-4.5, Qwen3-Coder): call_re's groups
    are the name and the tags, arg_re's a key and its value text, typed by the tool's schema."""
    def parse(text: str, tools: dict[str, dict]) -> Found:
        calls, spans = [], []
        for m in call_re.finditer(text):
            name = m.group(1).strip()
            if name not in tools:
                continue
            props = (tools[name] or {}).get("properties", {})
            args = {k.strip(): _typed_value(clean(v), props.get(k.strip(), {})) for k, v in arg_re.findall(m.group(2))}
            calls.append(call(name, args))
            spans.append(m.span())
        return calls, spans
    return parse


_QC = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>(?:\s*</tool_call>)?", re.DOTALL)
_QC_ARG = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_MM = re.compile(r'(?:<minimax:tool_call>\s*)?<invoke name="([^"\n]+)">(.*?)</invoke>(?:\s*</minimax:tool_call>)?',
                 re.DOTALL)
_MM_ARG = re.compile(r'<parameter name="([^"\n]+)">(.*?)</parameter>', re.DOTALL)
_glm45 = _tagged(_GLM, _GLM_ARG, str.strip)
_minimax = _tagged(_MM, _MM_ARG, str.strip)
_qwen3_coder = _tagged(_QC, _QC_ARG, _unwrap_lines)  # (a value's inner lines and indentation are kept)


_MISTRAL = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.:-]+)\s*(?:\[CALL_ID\]([A-Za-z0-9]*))?\s*\[ARGS\]")


def _mistral_id(written: object) -> str:
    """The id the model wrote for its call when it is one Mistral's templates take, else a new one."""
    if isinstance(written, str) and len(written) == 9 and written.isalnum():
        return written
    return new_call_id("mistral")


def _mistral(text: str, tools: dict[str, dict]) -> Found:
    calls, spans = [], []
    dec = json.JSONDecoder()
    at = text.find(_MISTRAL)
    while at >= 0:
        named = _MISTRAL_NAMED.match(text, at)
        start = named.end() if named else at + len(_MISTRAL)
        rest = len(text[start:]) - len(text[start:].lstrip())
        try:
            obj, end = dec.raw_decode(text, start + rest)
        except json.JSONDecodeError:
            at = text.find(_MISTRAL, at + 1)
            continue
        made = []
        if named:  # [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}
            c = _json_args(named.group(1), json.dumps(obj), tools, _mistral_id(named.group(2))) \
                if isinstance(obj, dict) else None
            made = [c] if c else []
        else:  # [TOOL_CALLS][{...}, ...] (or one object)
            for o in obj if isinstance(obj, list) else [obj]:
                if isinstance(o, dict) and o.get("name") in tools and isinstance(o.get("arguments", {}), dict):
                    made.append(call(o["name"], o.get("arguments", {}), _mistral_id(o.get("id"))))
        if made:
            calls.extend(made)
            spans.append((at, end))
        at = text.find(_MISTRAL, end)
    return calls, spans


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>\s*(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_FENCE = re.compile(r"^\s*([^\n`]*?)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
_DS_WRAP = re.compile(r"<｜tool▁calls▁begin｜>|<｜tool▁calls▁end｜>")


def _deepseek(text: str, tools: dict[str, dict]) -> Found:
    calls, spans = [], []
    for m in _DS_CALL.finditer(text):
        head, body = m.group(1).strip(), m.group(2)
        fenced = _DS_FENCE.match(body)
        if head == "function" and fenced:  # V3: function<sep>NAME ```json {...} ```
            c = _json_args(fenced.group(1), fenced.group(2), tools)
        else:  # V3.1: NAME<sep>{...}
            c = _json_args(head, body, tools)
        if c:
            calls.append(c)
            spans.append(m.span())
    return calls, spans


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                        re.DOTALL)
_KIMI_HEAD = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")
_KIMI_WRAP = re.compile(r"<\|tool_calls?_section_(?:begin|end)\|>")  # (the model sometimes writes "call")


def _kimi(text: str, tools: dict[str, dict]) -> Found:
    calls, spans = [], []
    for m in _KIMI_CALL.finditer(text):
        head = m.group(1)
        name = _KIMI_HEAD.fullmatch(head).group(1)  # type: ignore[union-attr] - (.+?) matches any head
        written = head if re.fullmatch(r"functions\.[^:\s]+:\d+", head) else None
        if c := _json_args(name, m.group(2), tools, written or new_call_id("kimi_k2", name, len(calls))):
            calls.append(c)
            spans.append(m.span())
    return calls, spans


_PY_WRAP = re.compile(r"<\|python_(?:start|end)\|>")
_PY_OPEN = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")  # a list's first call: "[name("
_PY_MAYBE = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")  # an end of text that may still grow into one
_JSON_WORDS = {"true": True, "false": False, "null": None}


def _py_value(node: ast.expr) -> Any:
    """A call argument's value: a Python literal, with JSON's true / false / null (the models write both)."""
    if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
        return _JSON_WORDS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def _py_calls(src: str, tools: dict[str, dict]) -> list[dict] | None:
    """The calls of a list like `[f(a=1), g()]` whose every call names a known tool, or None."""
    try:
        tree = ast.parse(src.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in tools \
                or node.args or any(kw.arg is None for kw in node.keywords):
            return None
        try:
            args = {kw.arg: _py_value(kw.value) for kw in node.keywords}
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
        calls.append(call(node.func.id, args))
    return calls


def _pythonic(text: str, tools: dict[str, dict]) -> Found:
    """The call list that ends the answer (after any text), wrapped in <|python_start|> / <|python_end|> or not."""
    for m in _PY_OPEN.finditer(text):
        calls = _py_calls(text[m.start():].rstrip().removesuffix("<|python_end|>"), tools)
        if calls is not None:
            before = text[:m.start()].rstrip()
            start = len(before) - len("<|python_start|>") if before.endswith("<|python_start|>") else m.start()
            return calls, [(start, len(text))]
    return [], []


_LFM2 = re.compile(r"<\|tool_call_start\|>\s*(.*?)\s*<\|tool_call_end\|>", re.DOTALL)


def _lfm2(text: str, tools: dict[str, dict]) -> Found:
    """Each call list between the markers, cut out where every call in it names a known tool."""
    calls, spans = [], []
    for m in _LFM2.finditer(text):
        got = _py_calls(m.group(1), tools)
        if got:
            calls += got
            spans.append(m.span())
    return calls, spans


_HUNYUAN = re.compile(r"<tool_calls>\s*(.*?)\s*</tool_calls>", re.DOTALL)


def _hunyuan(text: str, tools: dict[str, dict]) -> Found:
    """Each block's list of calls, cut out where every call in it names a known tool with object arguments."""
    calls, spans = [], []
    for m in _HUNYUAN.finditer(text):
        try:
            items = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        got = [call(it["name"], it.get("arguments", {})) for it in (items if isinstance(items, list) else [items])
               if isinstance(it, dict) and it.get("name") in tools and isinstance(it.get("arguments", {}), dict)]
        if got and len(got) == (len(items) if isinstance(items, list) else 1):
            calls += got
            spans.append(m.span())
    return calls, spans


_GRANITE = ("<|tool_call|>", "<tool_call>")


def _granite(text: str, tools: dict[str, dict]) -> Found:
    """Each marker's JSON list (or one object) of calls, cut out where every call names a known tool with object
    arguments."""
    calls, spans = [], []
    dec = json.JSONDecoder()
    at = min((i for i in (text.find(m) for m in _GRANITE) if i >= 0), default=-1)
    while at >= 0:
        start = at + len(next(m for m in _GRANITE if text.startswith(m, at)))
        start += len(text[start:]) - len(text[start:].lstrip())
        end = at + 1
        try:
            items, end = dec.raw_decode(text, start)
        except json.JSONDecodeError:
            items = None
        items = items if isinstance(items, list) else [items]
        got = [call(it["name"], it.get("arguments", {})) for it in items
               if isinstance(it, dict) and it.get("name") in tools and isinstance(it.get("arguments", {}), dict)]
        if got and len(got) == len(items):
            calls += got
            spans.append((at, end))
        at = min((i for i in (text.find(m, end) for m in _GRANITE) if i >= 0), default=-1)
    return calls, spans


def _gemma4(text: str, tools: dict[str, dict]) -> Found:
    calls, spans = [], []
    for m in gemma4_calls.CALL.finditer(text):
        args = gemma4_calls.arguments(m.group(2))
        if m.group(1) in tools and args is not None:
            calls.append(call(m.group(1), args))
            spans.append(m.span())
    return calls, spans


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opens: tuple[str, ...]  # text that starts a call: a stream's content goes out until one appears
    parser: Callable[[str, dict[str, dict]], Found]
    markers: tuple[str, ...]  # tokens the format writes, kept in the decoded text even if special
    strip: re.Pattern | None = None  # wrappers left around the calls once they are cut out
    in_reasoning: bool = False  # the model may open its calls inside an unclosed <think> (Kimi-K2-Thinking)
    open_re: re.Pattern | None = None  # a call's start as a pattern, besides `opens` (pythonic's "[name(")
    maybe_re: re.Pattern | None = None  # an end of text that may still grow into open_re's match
    think: tuple[str, str] = (OPEN, CLOSE)  # the reasoning's tags (Gemma 4's thought channel differs)

    def parse(self, text: str, tools: dict[str, dict]) -> tuple[str | None, list[dict]]:
        """(content, calls) of an answer: the calls naming known tools cut out of the text; the content
        None when nothing else was said."""
        calls, spans = self.parser(text, tools)
        if not calls:
            return text, []
        kept, last = [], 0
        for a, b in spans:
            kept.append(text[last:a])
            last = b
        kept.append(text[last:])
        content = "".join(kept)
        if self.strip is not None:
            content = self.strip.sub("", content)
        return content.strip() or None, calls


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", ("<tool_call>",), _hermes, ("<tool_call>", "</tool_call>")),
    ToolFormat("glm45", ("<tool_call>",), _glm45,
               ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    ToolFormat("qwen3_coder", ("<tool_call>", "<function="), _qwen3_coder, ("<tool_call>", "</tool_call>")),
    ToolFormat("mistral", (_MISTRAL,), _mistral, (_MISTRAL, "[ARGS]", "[CALL_ID]")),
    ToolFormat("deepseek", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), _deepseek,
               ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>"), _DS_WRAP),
    ToolFormat("minimax_m2", ("<minimax:tool_call>", "<invoke name="), _minimax,
               ("<minimax:tool_call>", "</minimax:tool_call>")),
    ToolFormat("kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>"), _kimi,
               ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
                "<|tool_call_section_end|>"), _KIMI_WRAP, in_reasoning=True),
    ToolFormat("pythonic", ("<|python_start|>",), _pythonic, ("<|python_start|>", "<|python_end|>"), _PY_WRAP,
               open_re=_PY_OPEN, maybe_re=_PY_MAYBE),
    ToolFormat("lfm2", ("<|tool_call_start|>",), _lfm2, ("<|tool_call_start|>", "<|tool_call_end|>")),
    ToolFormat("hunyuan", ("<tool_calls>",), _hunyuan, ("<tool_calls>", "</tool_calls>")),
    ToolFormat("granite", _GRANITE, _granite, _GRANITE),
    ToolFormat("gemma4", (gemma4_calls.OPEN,), _gemma4,
               (gemma4_calls.OPEN, gemma4_calls.CLOSE, gemma4_calls.QUOTE, "<|channel>", "<channel|>"),
               think=gemma4_calls.THINK),
)}
HARMONY = "harmony"  # gpt-oss: server/harmony.py
NAMES = (*FORMATS, HARMONY)


def detect(template: str) -> str:
    """The tool-call format a chat template teaches (hermes when it shows none)."""
    if "<|channel|>" in template:
        return HARMONY
    if gemma4_calls.OPEN in template:
        return "gemma4"
    if "<arg_key>" in template:
        return "glm45"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "tool▁call▁begin" in template:
        return "deepseek"
    if "tool_calls_section_begin" in template:
        return "kimi_k2"
    if "<minimax:tool_call>" in template:
        return "minimax_m2"
    if _MISTRAL in template:
        return "mistral"
    if "<|tool_call_start|>" in template:
        return "lfm2"
    if "<|python_start|>" in template or "[func_name1(" in template:
        return "pythonic"
    if "<tool_calls>" in template:
        return "hunyuan"
    if "<|tool_call|>" in template:
        return "granite"
    return "hermes"


class CallStream:
    """Streaming for tool_choice auto: text goes out as it comes until a call opens (a tail that could be
    the start of one is held back); from there on it is kept, and `finish()` parses it."""

    def __init__(self, fmt: ToolFormat, tools: dict[str, dict]):
        self.fmt, self.tools, self.held, self.calling = fmt, tools, "", False

    def push(self, piece: str) -> str:
        """The part of `piece` (with what was held back) that is content for sure."""
        self.held += piece
        if self.calling:
            return ""
        found = [at for o in self.fmt.opens if (at := self.held.find(o)) >= 0]
        if self.fmt.open_re is not None and (m := self.fmt.open_re.search(self.held)):
            found.append(m.start())
        if found:
            at = min(found)
            out, self.held, self.calling = self.held[:at], self.held[at:], True
            return out
        keep = max(held_tail(self.held, o) for o in self.fmt.opens)
        if self.fmt.maybe_re is not None and (m := self.fmt.maybe_re.search(self.held)):
            keep = max(keep, len(self.held) - m.start())
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content not sent yet, the tool calls)."""
        if not self.calling:
            return self.held or None, []
        return self.fmt.parse(self.held, self.tools)
