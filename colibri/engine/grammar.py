"""Structured output: a grammar that every generated token must keep the text inside of.

`SamplingParams.grammar` holds a grammar in llguidance's format (the library vLLM and llama.cpp use
for the same job), made by the helpers here from a JSON schema, a regular expression, or a Lark or
GBNF grammar. Before each token is picked, the tokens that would take the text out of the grammar get
-inf logits (after the bias and penalties, so nothing lifts them back); once the grammar is
complete, only the tokens that end the request are allowed (end of sequence, the chat template's
stop tokens), so the request finishes with `stop`, or with `length` if `max_tokens` cuts it first.
Log-probabilities stay the model's. llguidance is an optional dependency (`colibri[server]`,
`colibri[structured]`); asking for a grammar without it is a ColibriError.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ColibriError


def _llg():
    try:
        import llguidance
    except ImportError:
        raise ColibriError("structured output (a JSON schema, regex or grammar) needs llguidance: "
                           "pip install llguidance (or colibri[server])") from None
    return llguidance


def json_grammar(schema: Mapping[str, Any] | None = None) -> str:
    """Any JSON object (`schema` None: OpenAI's `json_object` mode), or JSON that follows `schema`."""
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping):
        raise ColibriError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        # Without flexible whitespace: a small model given the choice pads with spaces and newlines
        # until max_tokens (seen on the demo model); the separators are then JSON's usual ", " and ": ".
        return _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise ColibriError(f"bad JSON schema: {e}") from None


def regex_grammar(pattern: str) -> str:
    """Text that matches the regular expression `pattern` (whole)."""
    return _llg().LLMatcher.grammar_from_regex(pattern)


def lark_grammar(text: str) -> str:
    """Text of a Lark grammar (llguidance's dialect; its start rule is `start`)."""
    return _llg().LLMatcher.grammar_from_lark(text)


def gbnf_grammar(text: str) -> str:
    """Text of a GBNF grammar (llama.cpp's `--grammar`; its start rule is `root`), or a Lark one."""
    try:
        return _llg().grammar_from("gbnf", text)
    except ValueError as e:
        raise ColibriError(f"bad grammar: {e}") from None


class Constraint:
    """One request's grammar state: `mask(logits)` before a token is picked, `accept(token)` after.
    Once the text is complete, only the end tokens are allowed; once one is taken (a request with
    `ignore_eos` goes on past it), it stops constraining."""

    def __init__(self, matcher, end_ids: frozenset[int]):
        self.m, self.end_ids = matcher, end_ids
        self.ended = False

    @property
    def active(self) -> bool:
        return not self.ended and not self.m.is_error()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens the grammar does not allow next at -inf."""
        if not self.active:
            return logits
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(logits.shape[-1], dtype=bool)  # [V] (head rows beyond the mask: never allowed)
        got = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
        allowed[: got.shape[0]] = got
        if not allowed.any():  # (no token fits: leave the choice to the model rather than pick at random)
            return logits
        return logits.masked_fill(torch.from_numpy(~allowed), float("-inf"))

    def accept(self, token: int) -> None:
        if self.active:
            self.m.consume_token(token)
            self.ended = token in self.end_ids  # (the mask allows one only where the text may end)


class GrammarCompiler:
    """An engine's grammars: the tokenizer llguidance needs, made once per set of end tokens (a chat
    template's stop tokens differ from plain completion's), then one matcher per request."""

    def __init__(self, tokenizer, vocab_rows: int):
        self.tk, self.V = tokenizer, vocab_rows  # a `tokenizers.Tokenizer` (serialized on first use)
        self._tokenizers: dict[frozenset[int], Any] = {}
        self._lock = threading.Lock()  # requests come from any thread

    def constraint(self, grammar: str, end_ids: frozenset[int]) -> Constraint:
        llg = _llg()
        with self._lock:
            tok = self._tokenizers.get(end_ids)
            if tok is None:
                if not end_ids:
                    raise ColibriError("a grammar needs an end-of-sequence token to finish on; this model has none")
                try:
                    tok = llg.LLTokenizer(self.tk.to_str(), n_vocab=self.V, eos_token=sorted(end_ids))
                except Exception as e:  # noqa: BLE001 - the library raises plain exceptions
                    raise ColibriError(f"structured output: the model's tokenizer is not supported: {e}") from None
                self._tokenizers[end_ids] = tok
        m = llg.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise ColibriError(f"bad grammar: {m.get_error()}")
        return Constraint(m, end_ids)
