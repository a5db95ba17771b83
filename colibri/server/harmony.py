"""gpt-oss's answers (OpenAI's "harmony" format) as reasoning, content and tool calls.

After the prompt's `<|start|>assistant`, gpt-oss writes messages, each a header then a body:
`<|channel|>analysis<|message|>...<|end|>` (its reasoning), then
`<|start|>assistant<|channel|>final<|message|>...` (the answer; `<|return|>` ends the turn), or a call:
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (`<|call|>`
ends it; the recipient may also stand before the channel). `<|return|>` and `<|call|>` are stop tokens
and never reach this text; `<|end|>` closes one message only (chat_template.py does not stop on it here).
The markers are special tokens, kept in the decoded text for this parser (Relay's `keep`).

The analysis channel goes to `reasoning_content` (unless reasoning is off: then into the content too),
the final channel and commentary without a recipient (preambles) to `content`, calls to
`functions.NAME` of a known tool to `tool_calls`. Text with no header at all (a JSON grammar's answer)
is content.
"""

from __future__ import annotations

import json
import re

from .reasoning import held_tail
from .tool_formats import call

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>")
_ENDS = ("<|end|>", "<|start|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonySplit:
    """push(piece) -> (reasoning, content) certain so far; finish() -> (the rest of both, the calls)."""

    def __init__(self, tools: dict[str, dict] | None = None, reasoning: bool = True):
        self.tools, self.reasoning = tools or {}, reasoning
        self.buf, self.state = "", "header"  # header | body | plain
        self.first = True  # the answer's first header: text that cannot start one means no harmony at all
        self.target = "content"  # the body's: reasoning | content | call
        self.call_name, self.call_args = "", ""
        self.calls: list[dict] = []
        self.passthrough = False

    def _emit(self, text: str, out: list[str]) -> None:
        if self.target == "call":
            self.call_args += text
        elif self.target == "reasoning" and self.reasoning:
            out[0] += text
        else:
            out[1] += text

    def _close_call(self, out: list[str]) -> None:
        if self.target != "call":
            return
        try:
            args = json.loads(self.call_args) if self.call_args.strip() else {}
        except json.JSONDecodeError:
            args = None
        if self.call_name in self.tools and isinstance(args, dict):
            self.calls.append(call(self.call_name, args))
        else:  # an unknown tool or broken arguments: the model's text, as the other formats keep it
            out[1] += self.call_args
        self.target, self.call_args = "content", ""

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        out = ["", ""]
        while self.buf:
            if self.state == "plain":
                out[1], self.buf = out[1] + self.buf, ""
            elif self.state == "header":
                at = self.buf.find("<|message|>")
                if at < 0:
                    head = self.buf.lstrip()
                    if self.first and head and not head.startswith("<|") and not "<|".startswith(head):
                        self.state = "plain"
                        continue
                    break  # the header is still coming
                self.first = False
                head, self.buf = self.buf[:at], self.buf[at + len("<|message|>"):]
                channel = m.group(1) if (m := _CHANNEL.search(head)) else "final"
                to = m.group(1) if (m := _RECIPIENT.search(head)) else ""
                if to.startswith("functions."):
                    self.target, self.call_name, self.call_args = "call", to[len("functions."):], ""
                else:
                    self.target = "reasoning" if channel == "analysis" else "content"
                self.state = "body"
            else:  # body
                ends = [(at, m) for m in _ENDS if (at := self.buf.find(m)) >= 0]
                if not ends:
                    keep = max(held_tail(self.buf, m) for m in _ENDS)
                    self._emit(self.buf[: len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                at, m = min(ends)
                self._emit(self.buf[:at], out)
                self._close_call(out)
                self.buf, self.state = self.buf[at + len(m):], "header"  # (<|start|> opens the next one)
        return out[0], out[1]

    def finish(self) -> tuple[str, str, list[dict]]:
        out = ["", ""]
        if self.state in ("body", "plain"):
            self._emit(self.buf, out)
            self._close_call(out)
        elif self.buf.strip() and not self.calls:  # a header never finished: show what came
            out[1] += self.buf
        self.buf = ""
        return out[0], out[1], self.calls
