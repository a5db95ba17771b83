"""Streaming a forced tool call (tool_choice `required` or a named function) as it is written: OpenAI
clients get the call's name once known and its `arguments` in deltas, as vLLM streams them, instead of
the whole call once the answer is complete.

A named call's answer is its arguments' JSON; a required one's is `[{"name": ..., "arguments": {...}},
...]` (the grammar of server/tools.py), read here by a small scanner of JSON structure (depth, strings,
the keys of each item). Arguments written before their item's name are held until the name comes.
"""

from __future__ import annotations

import json

from .tool_formats import call, new_call_id


class ForcedCallStream:
    """push(piece) -> ("", "") (no reasoning, no content) while `take()` hands out the tool-call deltas the
    pieces completed; finish() -> ("", "", the calls): a whole answer's calls, and a stream's finish reason
    (their deltas were sent)."""

    passthrough = False
    sent_calls = True  # (the calls went out as deltas: the stream's end does not send them again)

    def __init__(self, named: str | None, fmt: str | None = None):
        self.named, self.fmt, self.text, self.deltas = named, fmt, "", []  # fmt: the ids' form (new_call_id)
        self.ids: list[str] = []
        # the required-array scanner
        self.depth, self.in_str, self.esc = 0, False, False
        self.key, self.expect_key, self.str_buf = None, False, ""
        self.items: list[dict] = []  # per item: name, args buffered before the name, announced
        self.in_args = False

    def _delta(self, index: int, **fn) -> None:
        d: dict = {"index": index, "function": fn}
        if "name" in fn:
            d.update(id=self.ids[index], type="function")
        if self.deltas and self.deltas[-1]["index"] == index and set(fn) == {"arguments"} \
                and set(self.deltas[-1]["function"]) == {"arguments"}:
            self.deltas[-1]["function"]["arguments"] += fn["arguments"]  # one delta per push and call
        else:
            self.deltas.append(d)

    def _args(self, text: str) -> None:
        it = self.items[-1]
        if not it["begun"]:  # (the spacing before the value is not the arguments')
            if not (text := text.lstrip()):
                return
            it["begun"] = True
        it["raw"] += text
        if it["announced"]:
            self._delta(len(self.items) - 1, arguments=text)
        else:
            it["held"] += text

    def _named_item(self, name: str) -> None:
        it = self.items[-1]
        it["name"], it["announced"] = name, True
        self.ids[-1] = new_call_id(self.fmt, name, len(self.items) - 1)
        self._delta(len(self.items) - 1, name=name, arguments="")
        if it["held"]:
            self._delta(len(self.items) - 1, arguments=it["held"])
            it["held"] = ""

    def _scan(self, ch: str) -> None:
        """One character of a required answer."""
        if self.in_args and not (self.depth == 2 and not self.in_str and ch in ",}"):
            self._args(ch)
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 2 and not self.in_args:
                    self._string_done(json.loads(f'"{self.str_buf}"'))
                return
            if self.depth == 2 and not self.in_args:
                self.str_buf += ch
            return
        if ch == '"':
            self.in_str, self.str_buf = True, ""
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2 and ch == "{":  # an item opens
                self.items.append({"name": None, "held": "", "announced": False, "begun": False, "raw": ""})
                self.ids.append("")  # (made with the name: some formats' ids spell it)
                self.expect_key = True
        elif ch in "}]":
            self.depth -= 1
        elif ch == ":" and self.depth == 2:
            self.expect_key = False
            self.in_args = self.key == "arguments"
        elif ch == "," and self.depth == 2:
            self.in_args, self.expect_key = False, True
        if self.depth < 2:
            self.in_args = False

    def _string_done(self, s: str) -> None:
        if self.expect_key:
            self.key = s
        elif self.key == "name" and self.items and self.items[-1]["name"] is None:
            self._named_item(s)

    def push(self, piece: str) -> tuple[str, str]:
        if self.named is not None:
            if not self.ids:
                self.ids.append(new_call_id(self.fmt, self.named))
                self._delta(0, name=self.named, arguments="")
            if piece:
                self._delta(0, arguments=piece)
        else:
            for ch in piece:
                self._scan(ch)
        self.text += piece
        return "", ""

    def take(self) -> list[dict]:
        out, self.deltas = self.deltas, []
        return out

    def finish(self) -> tuple[str, str, list[dict]]:
        """The complete calls (for `finish_reason`); none when the answer was cut before its JSON closed."""
        try:
            obj = json.loads(self.text)
        except json.JSONDecodeError:
            return "", "", []
        if self.named is not None:
            return "", "", [call(self.named, self.text, self.ids[0])]
        if not isinstance(obj, list) or len(obj) != len(self.items) or \
                not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in obj):
            return "", "", []  # (not the grammar's shape: no call)
        # each call's arguments as written (what was streamed), so streamed and whole answers agree
        return "", "", [call(c["name"], it["raw"].rstrip(), i) for i, c, it in zip(self.ids, obj, self.items)]

