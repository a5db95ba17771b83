"""The tokenizer embedded in the container (HF `tokenizers` JSON) plus its chat template."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from .errors import ColibriError


@lru_cache(maxsize=2)
def parse(text: str) -> _HFTokenizer:
    """The `tokenizers.Tokenizer` of a tokenizer.json text; cached, as the container check at open and
    the Engine parse the same text. A text the library refuses is one ColibriError line."""
    try:
        return _HFTokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ColibriError(f"the embedded tokenizer does not load: {msg[:200]}") from None


def _token_text(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, meta: dict, config: dict | None = None):
        if not isinstance(meta, dict) or not isinstance(meta.get("json"), str):
            raise ColibriError("the container has no embedded tokenizer")
        self.tk = parse(meta["json"])
        self.config = meta.get("tokenizer_config", {})
        self.chat_template = self.config.get("chat_template")
        self.eos_ids = self._eos_ids(meta, config or {})
        self.bos_token = _token_text(self.config.get("bos_token"))
        self._special: frozenset[int] | None = None

    def _eos_ids(self, meta: dict, config: dict) -> set[int]:
        ids: set[int] = set()
        for src in (meta.get("generation_config", {}).get("eos_token_id"), config.get("eos_token_id")):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list):
                ids.update(i for i in src if isinstance(i, int))
        eos = _token_text(self.config.get("eos_token"))
        if eos is not None and (i := self.tk.token_to_id(eos)) is not None:
            ids.add(i)
        return ids

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """The text of `ids`; `keep`: special tokens written even when the others are skipped (the markers
        a chat answer's parser reads, server/answer.py)."""
        if not keep or keep.isdisjoint(ids):
            return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids:
            if i in keep:
                parts.extend((self.tk.decode(run, skip_special_tokens=skip_special_tokens), self.tk.id_to_token(i)))
                run = []
            else:
                run.append(i)
        parts.append(self.tk.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def is_special(self, token_id: int) -> bool:
        """Whether decoding skips this token by default (an added token marked special)."""
        if self._special is None:
            self._special = frozenset(i for i, t in self.tk.get_added_tokens_decoder().items() if t.special)
        return token_id in self._special

    def template(self, name: str | None = None):
        """The model's chat template (`colibri.chat_template.ChatTemplate`; `name`: one of several named
        ones). ColibriError when the model has none."""
        from .chat_template import ChatTemplate, pick_template

        source = pick_template(self.chat_template, name)
        if source is None:
            raise ColibriError("this model has no chat template")
        return ChatTemplate(source, self.config, self.tk.token_to_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.template().render(messages, add_generation_prompt, **kwargs)


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, keep: frozenset[int] = frozenset()):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0
        # special tokens kept in the text (Tokenizer.decode's `keep`)
        self.decode = (lambda ids: tokenizer.decode(ids, keep=keep)) if keep else tokenizer.decode
        self.partial = False  # the last push held back part of a character (vs a token with no text)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        self.partial = after.endswith("\ufffd")
        if len(after) > len(before) and not self.partial:
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
