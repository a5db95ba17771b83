"""One chat answer's text as it comes, split into reasoning, content and tool calls.

What splits it depends on the model and the request: gpt-oss's channels (server/harmony.py), or a
`<think>` block (server/reasoning.py) followed by text in which tool calls are written in the model's
format (server/tool_formats.py). Both streams and whole answers go through the same splitter, so a
streamed answer adds up to the unstreamed one.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .harmony import MARKERS, HarmonySplit
from .reasoning import CLOSE, OPEN, AnswerTags, ThinkSplit
from .tool_formats import FORMATS, HARMONY, CallStream


class AnswerSplit:
    """push(piece) -> (reasoning, content) certain so far; finish() -> (the rest of both, the tool calls)."""

    def __init__(self, think: ThinkSplit | None, calls: CallStream | None, tags: AnswerTags | None = None):
        self.think, self.calls, self.tags = think, calls, tags
        self.passthrough = think is None and calls is None and tags is None  # every piece is content as it is

    def push(self, piece: str) -> tuple[str, str]:
        reasoning, text = self.think.push(piece) if self.think is not None else ("", piece)
        if self.tags is not None:
            text = self.tags.push(text)
        return reasoning, self.calls.push(text) if self.calls is not None else text

    def finish(self) -> tuple[str, str, list[dict]]:
        reasoning, rest = self.think.finish() if self.think is not None else ("", "")
        if self.tags is not None:
            rest = self.tags.push(rest) + self.tags.finish()
        made: list[dict] = []
        if self.calls is not None:
            rest = self.calls.push(rest) if rest else ""
            more, made = self.calls.finish()
            rest += more or ""
        return reasoning, rest, made


def splitter(fmt: str, tools: dict[str, dict] | None, think: bool, opened: bool,
             reasoning: bool, answer_tags: bool = False) -> AnswerSplit | HarmonySplit:
    """The splitter of one answer. fmt: the model's tool-call format (tool_formats.NAMES); tools: {name:
    parameters} when the model may call them (tool_choice auto), else None; think: split `<think>` off
    (`opened`: the prompt opened it); reasoning: the server's --reasoning-format is not none; answer_tags:
    drop `<answer>` / `</answer>` around the content (a template that shows them: Hunyuan-A13B's)."""
    if fmt == HARMONY:
        return HarmonySplit(tools, reasoning)
    f = FORMATS[fmt]
    ends = f.opens if tools is not None and f.in_reasoning else ()  # (a call opened in the reasoning ends it)
    return AnswerSplit(ThinkSplit(opened, ends, f.think) if think else None,
                       CallStream(f, tools) if tools is not None else None, AnswerTags() if answer_tags else None)


def whole(split: AnswerSplit | HarmonySplit, text: str) -> tuple[str, str | None, list[dict]]:
    """(reasoning, content, calls) of a whole answer; content None when a call is all there is."""
    r1, c1 = split.push(text)
    r2, c2, calls = split.finish()
    content = c1 + c2
    if calls:  # the text around the calls, without the spacing that led up to them
        return r1 + r2, content.strip() or None, calls
    return r1 + r2, content, calls


def think_tags(fmt: str) -> tuple[str, str]:
    """The opening and closing text of the format's reasoning."""
    return (OPEN, CLOSE) if fmt == HARMONY else FORMATS[fmt].think


def keep_ids(tok: Tokenizer, fmt: str) -> frozenset[int]:
    """The special tokens among the format's markers and its reasoning tags (<think> / </think>): decoding skips
    special tokens, and the splitters need these ones in the text."""
    markers = (*(MARKERS if fmt == HARMONY else FORMATS[fmt].markers), *think_tags(fmt))
    return frozenset(i for m in markers if (i := tok.tk.token_to_id(m)) is not None and tok.is_special(i))
