"""Tool calling for /v1/chat/completions: the request's tools go to the chat template, and the answer's
tool calls come back as OpenAI `tool_calls`.

How a call is obtained depends on `tool_choice`:
- `"required"`, or a named function: the answer is constrained by a grammar (engine/grammar.py) to JSON
  naming one of the tools with arguments that follow its `parameters` schema (vLLM does the same), so
  it is a well-formed call whatever the model's own tool-call format;
- `"auto"` (the default when tools are given): the model decides; calls written in the model's own
  format (server/tool_formats.py: Hermes, GLM-4.5, Mistral, DeepSeek, pythonic, ...; gpt-oss's in server/harmony.py)
  are parsed out of the text; the rest stays `content`;
- `"none"`: no tools reach the template, plain text.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import NamedChoice, Tool, ToolChoice, bad_request


@dataclass
class ToolPlan:
    """What one request's tools mean for its prompt, its sampling and its answer."""

    tools: list[Tool]
    mode: str  # auto | required | named
    named: str | None = None
    parallel: bool = True

    @property
    def schemas(self) -> dict[str, dict]:
        """{name: parameters schema}: what the format parsers check calls against."""
        return {t.function.name: self._params(t) for t in self.tools}

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
