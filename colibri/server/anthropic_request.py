"""Anthropic's Messages request (POST /v1/messages and /v1/messages/count_tokens): the body, validated as
strictly as the OpenAI ones (server/protocol.py: wrong types and values are 400s, unknown fields are
ignored), and what the chat path renders from it: template messages as an OpenAI chat request would give
them (tool calls with object arguments, tool results as `tool` messages), a tool plan, the template's
thinking switches. docs/SERVER.md lists every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from ..errors import ColibriError
from .protocol import FunctionDef, NamedChoice, NamedFunction, Tool, _Sampling, _Strict, bad_request
from .tools import ToolPlan
from .tools import plan as tool_plan

_KNOWN = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
BILLING = "x-anthropic-billing-header:"  # Claude Code's first system block: request metadata, not instructions
MAX_STOPS = 64  # stop sequences (each is checked against every token's text)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str | None = None


class OtherBlock(_Strict):
    """A block of a type this server does not take (image, document, server tools' blocks): refused by name."""

    type: str


def _kind(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in _KNOWN else "other"


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Block] | None = None
    is_error: bool | None = None

    def text(self, where: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        _refuse_other(self.content, where)
        return _texts(self.content, where, "a tool_result's content")


Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                  | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[OtherBlock, Tag("other")],
                  Discriminator(_kind)]
ToolResultBlock.model_rebuild()


def _type_of(b: Any) -> str:
    return getattr(b, "type", "?")


def _refuse_other(blocks: list, where: str) -> None:
    """A 400 naming the block types this server does not take (images and documents: it serves a text model)."""
    other = sorted({b.type for b in blocks if isinstance(b, OtherBlock)})
    if other:
        what = "text models take no images or documents" if set(other) & {"image", "document"} else \
            "supported: text, tool_use, tool_result, thinking, redacted_thinking"
        raise bad_request(f"{where}: content blocks of type {', '.join(repr(t) for t in other)} are not supported "
                          f"({what})", "messages", "unsupported_content")


class Message(_Strict):
    role: Literal["user", "assistant", "system"]  # system: instructions given mid-conversation (Claude Code's)
    content: str | list[Block]


class AnthropicTool(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")  # (Anthropic's names may be longer than OpenAI's 64)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" (or none); Anthropic's server tools (web_search_..., bash_...) are refused


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class PromptRequest(_Strict):
    """What makes the prompt: all of /v1/messages/count_tokens' body, the first half of /v1/messages'."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def refuse_unsupported(self) -> None:
        for n, m in enumerate(self.messages):
            if isinstance(m.content, list):
                _refuse_other(m.content, f"messages.{n}.content")
        for n, t in enumerate(self.tools or []):
            if t.type not in (None, "custom"):
                raise bad_request(f"tools.{n}: Anthropic's server tools (type '{t.type}') are not supported: give "
                                  "custom tools with an input_schema", "tools", "unsupported_parameter")
            if t.input_schema is None:
                raise bad_request(f"tools.{n}.input_schema: is required", "tools", "missing_parameter")
        tc = self.tool_choice
        if tc is not None and tc.type == "tool" and not tc.name:
            raise bad_request("tool_choice: a choice of type 'tool' needs the tool's name", "tool_choice")
        th = self.thinking
        if th is not None and th.type == "enabled" and (th.budget_tokens is None or th.budget_tokens < 1024):
            raise bad_request("thinking.budget_tokens: thinking of type 'enabled' needs a budget_tokens >= 1024",
                              "thinking")

    def plan(self) -> ToolPlan | None:
        """The tools as the OpenAI path plans them: auto, any (required), tool (named), none."""
        tools = [Tool.model_construct(type="function", function=FunctionDef.model_construct(
            name=t.name, description=t.description, parameters=t.input_schema, strict=None)) for t in self.tools or []]
        tc = self.tool_choice
        choice: Any = None
        if tc is not None:
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type)
            if tc.type == "tool":
                choice = NamedChoice(type="function", function=NamedFunction(name=tc.name or ""))
        return tool_plan(tools or None, choice, None if tc is None or tc.disable_parallel_tool_use is None
                    else not tc.disable_parallel_tool_use)

    def template_kwargs(self) -> dict:
        """`thinking` as the template's switches of thinking models (Qwen3 and GLM read `enable_thinking`,
        DeepSeek-V3.1 `thinking`); adaptive (or none) leaves the template's default: the model decides."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return {}
        on = self.thinking.type == "enabled"
        return {"enable_thinking": on, "thinking": on}

    def template_messages(self) -> tuple[list[dict], str]:
        """(the messages as the chat template takes them, the prefill: the text of a final assistant message,
        which the answer continues)."""
        out: list[dict] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else \
                "".join(b.text for b in self.system if not b.text.startswith(BILLING))
            if system:
                out.append({"role": "system", "content": system})
        messages, prefill = list(self.messages), ""
        if messages[-1].role == "assistant":
            prefill = _prefill(messages.pop())
        for n, m in enumerate(messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            if m.role == "system":
                out.append({"role": "system", "content": _texts(blocks, f"messages.{n}", "a system message")})
            else:
                out.extend(_user(blocks, n) if m.role == "user" else [_assistant(blocks, n)])
        return out, prefill


def _texts(blocks: list, where: str, what: str) -> str:
    if bad := next((b for b in blocks if not isinstance(b, TextBlock)), None):
        raise bad_request(f"{where}: {what} holds text blocks only, not '{_type_of(bad)}'", "messages")
    return "".join(b.text for b in blocks)


def _prefill(m: Message) -> str:
    text = m.content if isinstance(m.content, str) else \
        _texts(m.content, "messages", "a final assistant message (the answer's prefill)")
    if text != text.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace", "messages")
    return text


def _user(blocks: list, n: int) -> list[dict]:
    """A user turn: its tool results as `tool` messages, its text as user messages, in their order."""
    out: list[dict] = []
    text: list[str] = []
    for k, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": b.text(f"messages.{n}.content.{k}.content")})
        else:
            raise bad_request(f"messages.{n}.content.{k}: a user message cannot hold a '{_type_of(b)}' block",
                              "messages")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list, n: int) -> dict:
    """An assistant turn: its text, its tool calls (arguments as objects, as templates write them) and its
    reasoning (`reasoning_content`, which thinking models' templates may show; redacted reasoning is dropped)."""
    text, reasoning, calls = [], [], []
    for k, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif not isinstance(b, RedactedThinkingBlock):
            raise bad_request(f"messages.{n}.content.{k}: an assistant message cannot hold a '{_type_of(b)}' block",
                              "messages")
    out: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


class JsonFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: str | None = None  # (accepted, not used: the model's own template decides how long it thinks)
    format: JsonFormat | None = None


class MessagesRequest(PromptRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # (user_id: accepted, not used)
    stream: bool = False
    output_config: OutputConfig | None = None
    output_format: JsonFormat | None = None  # (the structured-outputs beta's name for output_config.format)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if any(not s for s in self.stop_sequences or []):
            raise bad_request("stop_sequences must not be empty strings", "stop_sequences")
        th = self.thinking
        if th is not None and th.type == "enabled" and th.budget_tokens is not None \
                and th.budget_tokens >= self.max_tokens:
            raise bad_request("max_tokens must be greater than thinking.budget_tokens", "max_tokens")

    def constraint(self) -> str | None:
        """The grammar of a structured output (`output_config.format`): JSON following its schema."""
        from ..engine.grammar import json_grammar

        fmt = (self.output_config.format if self.output_config is not None else None) or self.output_format
        if fmt is None:
            return None
        try:
            return json_grammar(fmt.schema_)
        except ColibriError as e:  # a schema the grammar cannot follow; llguidance missing
            raise bad_request(str(e), "output_config.format") from None

    def sampling_kw(self) -> dict:
        """Engine.submit's sampling keywords: the body's temperature / top_p / top_k, the chat path's
        defaults for the rest."""
        return _Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k).sampling_kw()
