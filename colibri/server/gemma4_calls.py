"""Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, in its own object syntax (and the
tags of its reasoning, `THINK`).

Keys are bare words (or strings); strings sit between `<|"|>` tokens, verbatim; numbers, true, false and null are
bare; objects `{...}` and lists `[...]` nest; items are comma-separated. `parse_value` reads that into Python values
(a JSON object for the OpenAI call); anything it cannot read leaves the call in the text.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THINK = ("<|channel>thought", "<channel|>")  # its reasoning: the thought channel, where other models write <think>
CALL = re.compile(r"<\|tool_call>\s*call:([^{\s]+)\s*(\{.*?\})\s*<tool_call\|>", re.DOTALL)
_WORD = re.compile(r"[^,:{}\[\]\s]+")


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _word(s: str, i: int) -> tuple[str, int]:
    m = _WORD.match(s, i)
    if m is None:
        raise ValueError(f"a value expected at {i}")
    return m.group(), m.end()


def _string(s: str, i: int) -> tuple[str, int]:
    end = s.find(QUOTE, i + len(QUOTE))
    if end < 0:
        raise ValueError("an unclosed string")
    return s[i + len(QUOTE):end], end + len(QUOTE)


def parse_value(s: str, i: int = 0) -> tuple[Any, int]:
    """The value at s[i:] (after blanks) -> (value, the index after it); ValueError / IndexError where it is not one."""
    i = _skip(s, i)
    if s.startswith(QUOTE, i):
        return _string(s, i)
    if s[i] not in "{[":
        word, end = _word(s, i)
        try:
            return json.loads(word), end
        except ValueError:
            return word, end  # (a bare word the model did not quote: its text)
    close = "}" if s[i] == "{" else "]"
    out: Any = {} if close == "}" else []
    i = _skip(s, i + 1)
    while s[i] != close:
        if close == "}":
            key, i = _string(s, i) if s.startswith(QUOTE, i) else _word(s, i)
            i = _skip(s, i)
            if s[i] != ":":
                raise ValueError(f"':' expected after the key {key!r}")
            out[key], i = parse_value(s, i + 1)
        else:
            value, i = parse_value(s, i)
            out.append(value)
        i = _skip(s, i)
        if s[i] == ",":
            i = _skip(s, i + 1)
        elif s[i] != close:
            raise ValueError(f"',' or {close!r} expected at {i}")
    return out, i + 1


def arguments(body: str) -> dict | None:
    """A call's `{...}` as an object, or None where it does not parse as one (whole)."""
    try:
        value, end = parse_value(body)
    except (ValueError, IndexError):
        return None
    return value if isinstance(value, dict) and _skip(body, end) == len(body) else None
