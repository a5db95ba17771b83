"""Chat templates: the model's own Jinja template, rendered the way transformers renders it.

Templates come from the Hub and are untrusted code, so they run in Jinja's immutable sandbox with
the helpers transformers gives them (`raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, `namespace`, loop controls, the `{% generation %}` block). A template that does
not compile, or fails while rendering, is a one-line `ColibriError`.

A template may come as one string or as named templates (`[{"name", "template"}]`, the
"default" one used unless another is asked for by name).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ColibriError

# End-of-turn tokens that chat templates write after a reply. One of them ends generation when
# the model's vocabulary has it as one token and the template writes it (GLM writes the next
# turn's <|user|> / <|observation|> marker instead of an end token).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>",
                      "<|return|>", "<|call|>", "<|user|>", "<|observation|>", "<|END_OF_TURN_TOKEN|>",
                      "<｜end▁of▁sentence｜>", "</s>")


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateError(Exception):
    """raise_exception() inside a template: the template's own message for the user."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers gives).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reaching CPython internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    return env


@cache
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ColibriError(f"the model's chat template is broken: {e.message} (template line {e.lineno})") from None


def _token_text(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def pick_template(chat_template: Any, name: str | None = None) -> str | None:
    """The template source from a tokenizer config's `chat_template` (a string or named templates)."""
    if chat_template is None or isinstance(chat_template, str):
        if name not in (None, "default"):
            raise ColibriError(f"the model has no chat template named '{name}'")
        return chat_template or None
    if isinstance(chat_template, list):
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        if (src := named.get(name or "default")) is not None:
            return src
        raise ColibriError(f"the model has no chat template named '{name or 'default'}' "
                           f"(it has: {', '.join(str(n) for n in named)})")
    raise ColibriError(f"the model's chat_template is a {type(chat_template).__name__}, not a string or a list")


class ChatTemplate:
    """A compiled chat template plus the special tokens it is rendered with.

    `special_tokens`: the tokenizer config's `*_token` entries (bos_token, eos_token, ...), which
    templates read as variables; `token_to_id`: the vocabulary, to find the template's stop tokens."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None,
                 token_to_id: Callable[[str], int | None] | None = None):
        self.source = source
        self.template = _compile(source)
        self.special = {k: t for k, v in (special_tokens or {}).items()
                        if k.endswith("_token") and isinstance(t := _token_text(v), str)}
        self.stop_ids: frozenset[int] = frozenset()
        if token_to_id is not None:
            # gpt-oss (harmony) writes <|end|> after each message of a turn (its reasoning, then the answer):
            # only <|return|> and <|call|> end its turn
            ends = [t for t in END_OF_TURN_TOKENS if t != "<|end|>" or "<|channel|>" not in source]
            self.stop_ids = frozenset(i for t in ends if self._writes(t) and (i := token_to_id(t)) is not None)

    def _writes(self, token: str) -> bool:
        """Whether the template writes `token`: literally, or through a special-token variable."""
        return token in self.source or any(v == token and k in self.source for k, v in self.special.items())

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (extra keyword arguments become template variables: tools,
        enable_thinking, ...)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.special, **kwargs})
        except _TemplateError as e:
            raise ColibriError(f"chat template: {e}") from None
        except jinja2.TemplateError as e:  # undefined variables, sandbox refusals, ...
            raise ColibriError(f"the model's chat template failed: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError,
                RecursionError) as e:
            raise ColibriError(f"the model's chat template failed on these messages: "
                               f"{type(e).__name__}: {e}") from None


def _read_text(path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ColibriError(f"cannot read chat template {path}: {e}") from None


def read_templates(folder, tokenizer_config: Mapping[str, Any] | None) -> str | list[dict] | None:
    """The chat templates of a Hugging Face folder, for the container: `chat_template.jinja` and
    `additional_chat_templates/NAME.jinja` (what current transformers saves), else `chat_template.json`,
    else tokenizer_config.json's `chat_template` (a string or named templates). One string when there
    is only a default template, else `[{"name", "template"}]`; None when there is none."""
    from pathlib import Path

    folder = Path(folder)
    named: dict[str, str] = {}
    in_config = (tokenizer_config or {}).get("chat_template")
    if isinstance(in_config, str):
        named["default"] = in_config
    elif isinstance(in_config, list):
        named.update((t["name"], t["template"]) for t in in_config
                     if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str))
    if (folder / "chat_template.json").is_file():
        try:
            src = json.loads(_read_text(folder / "chat_template.json")).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            raise ColibriError(f"{folder / 'chat_template.json'} is not a JSON object") from None
        if isinstance(src, str):
            named["default"] = src
    if (folder / "chat_template.jinja").is_file():
        named["default"] = _read_text(folder / "chat_template.jinja")
    for path in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        named[path.stem] = _read_text(path)
    if not named:
        return None
    if list(named) == ["default"]:
        return named["default"]
    return [{"name": n, "template": t} for n, t in named.items()]
