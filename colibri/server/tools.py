"""Tool calling for /v1/chat/completions: the request's tools go to the chat template, and the answer's
tool calls come back as OpenAI `tool_calls`.

How a call is obtained depends on `tool_choice`:
- `"required"`, or a named function: the answer is constrained by a grammar (engine/grammar.py) to JSON
  naming one of the tools with arguments that follow its `parameters` schema (vLLM does the same), so
  it is a well-formed call whatever the model's own tool-call format;
- `"auto"` (the default when tools are given): the model decides; calls written in the Hermes format
  that Qwen's templates (and many others) teach, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  are parsed out of the text; the rest stays `content`. Other formats come back as plain text;
- `"none"`: no tools reach the template, plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .protocol import NamedChoice, Tool, ToolChoice, bad_request

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def call(name: str, arguments: Any) -> dict:
    """One OpenAI tool call; `arguments` as the JSON text OpenAI sends."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ToolPlan:
    """What one request's tools mean for its prompt, its sampling and its answer."""

    tools: list[Tool]
    mode: str  # auto | required | named
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    @property
    def template_tools(self) -> list[dict]:
        """The tools as chat templates expect them (transformers' convention)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _params(self, t: Tool) -> dict:
        return t.function.parameters or {"type": "object", "properties": {}}

    def grammar(self) -> str | None:
        """None for auto (the model writes what it wants); else the JSON the answer must be."""
        from ..engine.grammar import json_grammar

        if self.mode == "named":
            return json_grammar(self._params(next(t for t in self.tools if t.function.name == self.named)))
        if self.mode != "required":
            return None
        one = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": self._params(t)},
                "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
        if not self.parallel:
            schema["maxItems"] = 1
        return json_grammar(schema)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of an answer. An answer cut short (max_tokens) that does not parse comes
        back as content."""
        if self.mode == "named":
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, [call(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, [call(c["name"], c["arguments"]) for c in items]
        return hermes_calls(text, self.names)


def hermes_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """Calls in `<tool_call>{"name", "arguments"}</tool_call>` blocks naming a known tool; the text around
    them is the content (None when nothing else was said). Blocks that do not parse stay in the text."""
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(call(obj["name"], args))
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


class HermesStream:
    """Streaming for tool_choice auto: text goes out as it comes until a `<tool_call>` opens (a tail that
    could be the start of one is held back); from there on it is kept, and `finish()` parses it."""

    OPEN = "<tool_call>"

    def __init__(self, names: set[str]):
        self.names, self.held, self.calling = names, "", False

    def push(self, piece: str) -> str:
        """The part of `piece` (with what was held back) that is content for sure."""
        self.held += piece
        if self.calling:
            return ""
        at = self.held.find(self.OPEN)
        if at >= 0:
            out, self.held, self.calling = self.held[:at], self.held[at:], True
            return out
        keep = next((n for n in range(min(len(self.OPEN) - 1, len(self.held)), 0, -1)
                     if self.OPEN.startswith(self.held[-n:])), 0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content not sent yet, the tool calls)."""
        if not self.calling:
            return self.held or None, []
        content, calls = hermes_calls(self.held, self.names)
        return content, calls


def plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan, or None when it uses no tools (none given, or tool_choice "none")."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    if choice == "none":
        return None
    if isinstance(choice, NamedChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names '{choice.function.name}', which is not among the tools",
                              "tool_choice")
        return ToolPlan(tools, "named", choice.function.name, parallel is not False)
    return ToolPlan(tools, choice or "auto", None, parallel is not False)
