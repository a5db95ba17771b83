"""A chat request's prompt and the splitter of its answer, shared by every chat-shaped API (OpenAI's chat
completions, and through them Responses and Ollama; Anthropic's Messages): the same template rendering,
tool plan and reasoning / tool-call parsing, so each API answers what the others would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ColibriError
from .answer import AnswerSplit, splitter, think_tags
from .harmony import HarmonySplit
from .protocol import APIError, bad_request
from .reasoning import opens_thinking
from .tool_stream import ForcedCallStream
from .tools import ToolPlan


@dataclass
class ChatPrompt:
    text: str  # the rendered template
    ids: list[int]
    plan: ToolPlan | None
    forced: str | None  # the grammar of a required / named tool call, else None

    def splitter(self, state, think: bool) -> Callable[[], AnswerSplit | HarmonySplit | ForcedCallStream]:
        """A maker of this answer's splitter (one per choice). think: split the reasoning off (not with a
        grammar: a JSON grammar writes no <think>)."""
        plan, opened = self.plan, think and opens_thinking(self.text, think_tags(state.tool_format))
        if self.forced is not None:
            named = plan.named if plan is not None and plan.mode == "named" else None
            return lambda: ForcedCallStream(named, state.tool_format)
        tools = plan.schemas if plan is not None and plan.mode == "auto" else None
        return lambda: splitter(state.tool_format, tools, think, opened, state.reasoning, state.answer_tags)


def chat_prompt(state, messages: list[dict], plan: ToolPlan | None, template_kwargs: dict | None = None,
                prefill: str = "") -> ChatPrompt:
    """Render `messages` (template dicts) with the generation prompt; `prefill`: text the answer continues
    (Anthropic's final assistant message), written after the generation prompt."""
    if state.template is None:
        raise APIError(400, f"chat completions need a chat template: {state.template_error}", "no_chat_template")
    try:
        forced = plan.grammar() if plan is not None else None
    except ColibriError as e:  # a tool's schema the grammar cannot follow; llguidance missing
        raise bad_request(str(e), "tools") from None
    extra = {"tools": plan.template_tools} if plan is not None else {}
    try:
        text = state.template.render(messages, True, **extra, **(template_kwargs or {})) + prefill
    except ColibriError as e:
        raise bad_request(str(e), "messages", "chat_template_error") from None
    except TypeError as e:  # (template variables that clash with the renderer's own arguments)
        raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
    ids = state.tok.encode(text, add_special_tokens=False)  # the template writes its own special tokens
    return ChatPrompt(text, ids, plan, forced)
