"""A tiktoken vocabulary (`tiktoken.model`: Kimi-K2, Moonlight) as a `tokenizers` JSON, which the converter
embeds like any tokenizer.json.

The file is one line per token, `base64(bytes) rank`, ranks 0..n-1 being the ids. What it lacks comes from
the model's repository: the split regex is the `pat_str` of its tokenizer code (tokenization_*.py, read as
literals, never run), and the special tokens take the ids n, n+1, ... (tokenizer_config.json's
added_tokens_decoder names them, `<|reserved_token_{id}|>` the rest, as the model's code does).

tiktoken merges the adjacent pair whose concatenation has the lowest rank; a `tokenizers` BPE the pair
listed first among its merges. So every split of a token into two tokens becomes a merge, listed in the
order of the token's rank, and a piece that is a whole token is taken as is (`ignore_merges`, as tiktoken
does): the same ids (tests/test_tiktoken.py checks them against tiktoken itself).
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
from functools import lru_cache
from pathlib import Path

from ..errors import ColibriError

FILE = "tiktoken.model"
RESERVED = 258  # special ids after the vocabulary in the models' own tokenizer code (256 + 2)


@lru_cache(maxsize=1)
def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte: bytes that print stay themselves, the rest map past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _text(token: bytes) -> str:
    chars = _byte_chars()
    return "".join(chars[b] for b in token)


def read_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank, from a tiktoken.model file; a clear error on a line that is not `base64 rank`."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ColibriError(f"cannot read {path}: {e.strerror or e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            raise ColibriError(f"{path}:{i}: not a tiktoken line (base64 token, space, rank)") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ColibriError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _literal(node: ast.AST) -> str | None:
    """A string the expression spells with literals only: "a", "a" + "b", "|".join(["a", ...])."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _literal(node.left), _literal(node.right)
        return None if a is None or b is None else a + b
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.List | ast.Tuple)):
        sep = _literal(node.func.value)
        parts = [_literal(e) for e in node.args[0].elts]
        return None if sep is None or None in parts else sep.join(parts)  # type: ignore[arg-type]
    return None


def read_pattern(folder: Path) -> str:
    """The split regex (`pat_str = ...`) of the tokenizer code in `folder`, read without running it."""
    for py in sorted(folder.glob("tokenization_*.py")):
        try:
            tree = ast.parse(py.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pat_str"
                                                    for t in node.targets):
                if (pat := _literal(node.value)) is not None:
                    return pat
    raise ColibriError(f"{folder} has {FILE} but no tokenization_*.py whose pat_str (the split regex) is "
                       "written with string literals: copy the model's tokenizer code next to it")


def _specials(n: int, tokenizer_config: dict, vocab_rows: int | None) -> dict[int, str]:
    named = {}
    for k, v in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        content = v.get("content") if isinstance(v, dict) else None
        if str(k).isdigit() and isinstance(content, str):
            named[int(k)] = content
    top = n + RESERVED if vocab_rows is None else min(n + RESERVED, vocab_rows)
    ids = sorted(set(range(n, top)) | {i for i in named if vocab_rows is None or i < vocab_rows})
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in ids}


def tokenizer_json(folder: Path, tokenizer_config: dict, vocab_rows: int | None = None) -> str:
    """The tokenizer.json text equivalent to `folder`'s tiktoken.model, split regex and special tokens."""
    ranks = read_ranks(folder / FILE)
    pattern = read_pattern(folder)
    vocab = {_text(t): r for t, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []  # (rank of the result, of left, of right, left, right)
    for tok, r in ranks.items():
        for cut in range(1, len(tok)):
            a, b = tok[:cut], tok[cut:]
            ra, rb = ranks.get(a), ranks.get(b)
            if ra is not None and rb is not None:
                merges.append((r, ra, rb, _text(a), _text(b)))
    merges.sort()
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, s in _specials(len(ranks), tokenizer_config, vocab_rows).items()]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [[m[3], m[4]] for m in merges]},
    }
    return json.dumps(spec, ensure_ascii=False)
