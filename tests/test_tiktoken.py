"""tiktoken vocabularies (Kimi-K2, Moonlight ship `tiktoken.model`, no tokenizer.json): the converter embeds
them as a `tokenizers` JSON giving tiktoken's own ids, and a `kimi_k2` checkpoint (DeepSeek-V3's layout)
converts and matches transformers' DeepSeek-V3."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import TRAIN_TEXT, VOCAB_SIZE, hf_logits, load_hf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import colibri
from colibri.convert import tiktoken_bpe
from colibri.convert.converter import convert
from colibri.errors import ColibriError

# Kimi-K2's split regex (its tokenization_kimi.py), as pieces: Han runs, words with &&-intersected classes,
# 1-3 digits, punctuation, newlines, spaces.
KIMI_PIECES = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
KIMI_PATTERN = "|".join(KIMI_PIECES)
EXTRA_TEXT = "\n中文分词测试，模型很大。日本語のテキスト 12345 ÄÖÜ éèà Don'T THE'S\r\n\t  end"
SAMPLES = [TRAIN_TEXT[:2000], EXTRA_TEXT, "Hello World's 3.14159 1234567 !!", "  leading\n\n\ttabs  \r\n end ",
           "中文English混合123", "<|im_end|>x[EOS] y<|reserved_token_999|>", "emoji 🙂🙃 ß ﬁ ǅ"]


def _ranks(size: int) -> dict[bytes, int]:
    """A tiktoken vocabulary of `size` tokens: the 256 bytes, then a byte-level BPE's merges in order."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([TRAIN_TEXT + EXTRA_TEXT], trainers.BpeTrainer(
        vocab_size=size + 64, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    byte_of = {c: b for b, c in enumerate(tiktoken_bpe._byte_chars())}
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in json.loads(tk.to_str())["model"]["merges"]:
        ranks.setdefault(bytes(byte_of[c] for c in a + b), len(ranks))
        if len(ranks) == size:
            break
    return ranks


def _write(folder: Path, ranks: dict[bytes, int], names: dict[int, str]) -> dict:
    """tiktoken.model, a tokenization_kimi.py spelling pat_str as Kimi's does, and the tokenizer_config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    lines = "".join(f'            r"""{p}""",\n' for p in KIMI_PIECES)
    (folder / "tokenization_kimi.py").write_text(
        f'import tiktoken\n\n\nclass TikTokenTokenizer:\n    pat_str = "|".join(\n        [\n{lines}        ]\n    )\n')
    cfg = {"added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in names.items()},
           "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return cfg


def test_a_tiktoken_vocabulary_gives_tiktokens_ids(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = _ranks(700)
    n = len(ranks)
    cfg = _write(tmp_path, ranks, {n: "[BOS]", n + 1: "[EOS]", n + 3: "<|im_end|>"})
    ours = Tokenizer.from_str(tiktoken_bpe.tokenizer_json(tmp_path, cfg, n + 1000))
    specials = {s: i for i, s in tiktoken_bpe._specials(n, cfg, n + 1000).items()}
    assert len(specials) == tiktoken_bpe.RESERVED and specials["<|im_end|>"] == n + 3
    assert specials[f"<|reserved_token_{n + 2}|>"] == n + 2  # (unnamed ids: the models' own naming)
    ref = tiktoken.Encoding(name="t", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    for text in SAMPLES:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, allowed_special="all"), text[:40]
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    # special ids beyond the model's vocabulary rows are not made
    assert max(tiktoken_bpe._specials(n, cfg, n + 2)) == n + 1


def test_kimi_k2_converts_from_tiktoken_and_matches_transformers(ckpt, tmp_path):
    """A Kimi-K2 folder (model_type kimi_k2, tiktoken.model, no tokenizer.json) converts as DeepSeek-V3 and
    gives transformers' DeepseekV3 logits on the same weights; the embedded tokenizer encodes as the file."""
    ref = ckpt.hf("deepseek_v3")
    src = tmp_path / "kimi"
    shutil.copytree(ref, src)
    (src / "tokenizer.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "kimi_k2"}))
    ranks = _ranks(VOCAB_SIZE - 40)
    n = len(ranks)
    _write(src, ranks, {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>"})
    path = convert(src, tmp_path / "kimi.coli", "f32", progress=False)
    llm = colibri.load(path)
    try:
        text = "The expert cache, 中文 123."
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        assert ids == Tokenizer.from_str(tiktoken_bpe.tokenizer_json(src, {}, VOCAB_SIZE)).encode(text).ids
        assert llm.tokenizer.decode(ids) == text
        ids = ids[:12]
        got = llm.logits(ids)
        want = hf_logits(load_hf(ref), ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        llm.close()


def test_bad_tiktoken_files_are_named(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    _write(tmp_path, ranks, {})
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ColibriError, match=r"tiktoken.model:2: not a tiktoken line"):
        tiktoken_bpe.tokenizer_json(tmp_path, {})
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ColibriError, match="ranks are not 0..1"):
        tiktoken_bpe.tokenizer_json(tmp_path, {})
    (tmp_path / "tiktoken.model").write_text("YQ== 0\n")
    (tmp_path / "tokenization_kimi.py").write_text("pat_str = make_pattern()\n")  # not literals: never run
    with pytest.raises(ColibriError, match="pat_str"):
        tiktoken_bpe.tokenizer_json(tmp_path, {})
