"""Seeded mutants of a valid `.coli` container and of a valid Hugging Face folder (tests/test_fuzz.py).

Every generator takes a `random.Random` and returns `(description, ...)`; the same seed gives the same
mutant. Container mutants are whole files (bytes); HF mutants are folders written next to the base one.
Categories (docs/FORMAT.md, "What a reader accepts"):

- corruption (the header crc is NOT fixed up): `preamble`, `header_flip`, `data_flip`, `truncate`;
- rewrites (the header crc IS fixed up, as a hostile writer would): `header_bytes`, `config`, `index`,
  `json`, `tokenizer`, `quant`;
- HF folders for `colibri convert`: `hf_config`, `hf_safetensors`, `hf_tensors`, `hf_tokenizer`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

PREAMBLE = struct.Struct("<8sIIQQIQ")
CORRUPTION = ("preamble", "header_flip", "data_flip", "truncate")
REWRITES = ("header_bytes", "config", "index", "json", "tokenizer", "quant")
CONTAINER_CATEGORIES = CORRUPTION + REWRITES
HF_CATEGORIES = ("hf_config", "hf_safetensors", "hf_tensors", "hf_tokenizer")

# Values a rewritten field takes: wrong types, zero, negative, huge, fractional, non-finite.
BAD_VALUES: list[Any] = [0, -1, -(2**31), 2**40, 10**9, 1.5, -0.5, 1e-30, "7", "abc", None, True, [], {}, [1, 2],
                         {"a": 1}, math.nan, math.inf, -math.inf, 3]


def split(blob: bytes) -> tuple[tuple, dict]:
    pre = PREAMBLE.unpack_from(blob)
    h_off, h_len = pre[3], pre[4]
    return pre, json.loads(blob[h_off : h_off + h_len])


def with_header(blob: bytes, header_bytes: bytes) -> bytes:
    """The file with its JSON header replaced and the preamble (length, crc, size) fixed up."""
    magic, version, flags, h_off, _, _, _ = PREAMBLE.unpack_from(blob)
    n = len(header_bytes)
    pre = PREAMBLE.pack(magic, version, flags, h_off, n, zlib.crc32(header_bytes), h_off + n)
    return pre + blob[len(pre) : h_off] + header_bytes


def dump(h: Any) -> bytes:
    # allow_nan: a hostile writer may well emit NaN / Infinity tokens
    return json.dumps(h, allow_nan=True, separators=(",", ":")).encode()


def _flip(blob: bytes, pos: int, rng: random.Random) -> bytes:
    b = bytearray(blob)
    b[pos] ^= 1 << rng.randrange(8)
    return bytes(b)


# ----------------------------------------------------------------------------- containers


def container_mutant(blob: bytes, category: str, rng: random.Random) -> tuple[str, bytes]:
    return GENERATORS[category](blob, rng)


def _preamble(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    pos = rng.randrange(44) if rng.random() < 0.8 else rng.randrange(44, 4096)
    return f"flip preamble byte {pos}", _flip(blob, pos, rng)


def _header_flip(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    h_off = PREAMBLE.unpack_from(blob)[3]
    pos = rng.randrange(h_off, len(blob))
    return f"flip header byte {pos - h_off}", _flip(blob, pos, rng)


def _data_flip(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    pre, h = split(blob)
    if rng.random() < 0.8:  # inside a tensor (uniform over tensors, not bytes: small ones matter too)
        live = [(n, e) for n, e in h["tensors"].items() if e["nbytes"]]
        name, e = rng.choice(live)
        pos = e["offset"] + rng.randrange(e["nbytes"])
        return f"flip data byte in {name}", _flip(blob, pos, rng)
    used = bytearray(pre[3])
    for e in h["tensors"].values():
        used[e["offset"] : e["offset"] + e["nbytes"]] = b"\1" * e["nbytes"]
    gaps = [i for i in range(4096, pre[3], 61) if not used[i]]
    pos = rng.choice(gaps)
    return f"flip padding byte at {pos}", _flip(blob, pos, rng)


def _truncate(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    r = rng.random()
    if r < 0.5:
        n = rng.choice([0, 1, 7, 8, 43, 44, 4095, 4096, rng.randrange(len(blob))])
        return f"truncate to {n}", blob[:n]
    if r < 0.75:
        return "append bytes", blob + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5000)))
    # truncate, then make the preamble's file_size agree (so only the header location is wrong)
    n = rng.randrange(4096, len(blob))
    magic, v, f, h_off, h_len, crc, _ = PREAMBLE.unpack_from(blob)
    pre = PREAMBLE.pack(magic, v, f, h_off, h_len, crc, n)
    return f"truncate to {n}, file_size fixed", (pre + blob[len(pre) :])[:n]


def _header_bytes(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    h_off = PREAMBLE.unpack_from(blob)[3]
    raw = bytearray(blob[h_off:])
    pos = rng.randrange(len(raw))
    raw[pos] = rng.choice(b'0123456789{}[]",:-.eE ntfx\\\x00\xff')
    return f"header byte {pos} rewritten, crc fixed", with_header(blob, bytes(raw))


def _config_paths(cfg: dict) -> list[tuple[str, ...]]:
    paths = [(k,) for k in cfg]
    paths += [(k, sub) for k, v in cfg.items() if isinstance(v, dict) for sub in v]
    return paths + [("brand_new_key",)]


def _set(d: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def _config(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    _, h = split(blob)
    path = rng.choice(_config_paths(h["meta"]["config"]))
    value = rng.choice(BAD_VALUES)
    _set(h["meta"]["config"], path, value)
    return f"config {'.'.join(path)} = {value!r}", with_header(blob, dump(h))


def _index(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    _, h = split(blob)
    tensors, records = h["tensors"], h["records"]
    r = rng.random()
    if r < 0.55:
        name = rng.choice(list(tensors))
        e = tensors[name]
        key = rng.choice(["dtype", "shape", "offset", "nbytes", "crc32", "crc32c", "record", "extra"])
        options: dict[str, list] = {
            "dtype": ["f32", "f16", "bf16", "i8", "u8", "i32", "f64", 7, None],
            "shape": [list(reversed(e["shape"])), [-1], ["a"], [10**12], [], e["shape"] + [1], [0] * 2, 5],
            "offset": [e["offset"] + 64, e["offset"] + 4096, e["offset"] - 4096, 0, 10**15, "x", -64, 1.5],
            "nbytes": [e["nbytes"] + 1, e["nbytes"] - 1, 0, -1, 10**15, None],
            "crc32": [(e.get("crc32", 0) + 1) % 2**32, -1, 2**40, "x"],
            "crc32c": [(e.get("crc32c", 0) + 1) % 2**32, -1, 2**40, "x", None],
            "record": ["nope", 3, None],
            "extra": [{"deep": [1, 2, {"x": None}]}],
        }
        value = rng.choice(options[key])
        if key == "crc32c" and value is None:
            e.pop("crc32c", None)
            return f"tensor {name}: crc32c removed", with_header(blob, dump(h))
        e[key] = value
        return f"tensor {name}: {key} = {value!r}", with_header(blob, dump(h))
    if r < 0.85:
        name = rng.choice(list(records))
        rec = records[name]
        key = rng.choice(["offset", "nbytes", "tensors", "crc32c", "drop_member", "delete"])
        if key == "delete":
            del records[name]
            return f"record {name} deleted", with_header(blob, dump(h))
        if key == "drop_member":
            sub = rng.choice(list(rec["tensors"]))
            del rec["tensors"][sub]
            return f"record {name}: member {sub} dropped", with_header(blob, dump(h))
        options = {"offset": [rec["offset"] + 4096, rec["offset"] - 4096, 0, "x"],
                   "nbytes": [rec["nbytes"] - 64, rec["nbytes"] + 4096, 0, -1],
                   "tensors": [[], {"x": "nope"}, None],
                   "crc32c": [(rec.get("crc32c", 0) + 1) % 2**32, "x"]}
        value = rng.choice(options[key])
        rec[key] = value
        return f"record {name}: {key} = {value!r}", with_header(blob, dump(h))
    name = rng.choice([n for n in tensors if "record" not in tensors[n]])
    if rng.random() < 0.5:
        del tensors[name]
        return f"tensor {name} deleted", with_header(blob, dump(h))
    tensors[name.replace("layers.0.", "layers.7.") if "layers.0." in name else name + ".x"] = tensors.pop(name)
    return f"tensor {name} renamed", with_header(blob, dump(h))


def _json(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    _, h = split(blob)
    raw = dump(h)
    kind = rng.choice(["nan", "inf", "deep", "list", "dup", "utf8", "meta", "tensors", "bigint", "bignum",
                       "bom", "trailing", "empty", "records"])
    if kind == "nan":
        h["meta"]["config"]["rms_norm_eps"] = math.nan
        out = dump(h)
    elif kind == "inf":
        h["meta"]["config"]["hidden_size"] = math.inf
        out = dump(h)
    elif kind == "deep":
        depth = rng.choice([100, 5000, 200000])
        h["meta"]["config"]["x"] = "@@"
        out = dump(h).replace(b'"@@"', b"[" * depth + b"]" * depth)
    elif kind == "list":
        out = b"[" + raw + b"]"
    elif kind == "dup":
        out = raw[:-1] + b',"meta":{}}'
    elif kind == "utf8":
        out = raw.replace(b'"meta"', b'"me\xfft\xc3"', 1)
    elif kind == "meta":
        h["meta"] = rng.choice([[], "x", None, {"model_type": 5, "config": []}])
        out = dump(h)
    elif kind == "tensors":
        h["tensors"] = rng.choice([[], None, {"a": 1}])
        out = dump(h)
    elif kind == "records":
        h["records"] = rng.choice([[], {"r": {"offset": 4096, "nbytes": 0, "tensors": {"a": 5}}}])
        out = dump(h)
    elif kind == "bigint":
        out = raw.replace(b'"format"', b'"x":' + b"9" * 5000 + b',"format"', 1)
    elif kind == "bignum":
        h["meta"]["config"]["hidden_size"] = "@@"
        out = dump(h).replace(b'"@@"', b"1e400")
    elif kind == "bom":
        out = b"\xef\xbb\xbf" + raw
    elif kind == "trailing":
        out = raw + b" x"
    else:
        out = b""
    return f"json {kind}", with_header(blob, out)


def _tokenizer(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    _, h = split(blob)
    tok = h["meta"]["tokenizer"]
    kind = rng.choice(["garbage", "binary", "notobj", "wrongobj", "idhigh", "addedhigh", "tcfg", "template",
                       "gencfg", "eos", "stm", "missing", "meta_str", "eos_token"])
    if kind == "garbage":
        tok["json"] = tok["json"][: rng.randrange(len(tok["json"]))]
    elif kind == "binary":
        tok["json"] = "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(200))
    elif kind == "notobj":
        tok["json"] = rng.choice(["[]", "5", "null", '"x"', 7, None, ["a"]])
    elif kind == "wrongobj":
        tok["json"] = json.dumps({"model": {"type": "BPE", "vocab": "x"}})
    elif kind in ("idhigh", "addedhigh"):
        t = json.loads(tok["json"])
        if kind == "idhigh":
            t["model"]["vocab"]["zzzz"] = rng.choice([10**6, 2**31 - 1, 384, 100000])
        else:
            t["added_tokens"].append({"id": rng.choice([10**6, 5000, 384]), "content": "<hi>", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False, "special": True})
        tok["json"] = json.dumps(t)
    elif kind == "tcfg":
        tok["tokenizer_config"] = rng.choice([[], "x", 5, {"eos_token": 7}, {"bos_token": ["a"]}])
    elif kind == "template":
        tok.setdefault("tokenizer_config", {})["chat_template"] = rng.choice([5, ["x"], {"a": 1}, "{% if %}"])
    elif kind == "gencfg":
        tok["generation_config"] = rng.choice([[], "x", 5, [1, 2]])
    elif kind == "eos":
        tok.setdefault("generation_config", {})["eos_token_id"] = rng.choice(["x", -1, 10**9, 1.5, [1, "x"], [-3]])
    elif kind == "stm":
        tok["special_tokens_map"] = rng.choice([[], "x"])
    elif kind == "missing":
        del h["meta"]["tokenizer"]
    elif kind == "meta_str":
        h["meta"]["tokenizer"] = rng.choice(["x", [], 5])
    else:
        tok.setdefault("tokenizer_config", {})["eos_token"] = rng.choice([{"content": 5}, ["x"], "never-a-token"])
    return f"tokenizer {kind}", with_header(blob, dump(h))


def _quant(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    _, h = split(blob)
    if rng.random() < 0.4:
        value = rng.choice([[], "x", None, 5, {"scheme": "int9"}, {"scheme": "int4", "group_size": 0},
                            {"scheme": "int8", "group_size": "x"}, {"scheme": 5}])
        h["meta"]["quant"] = value
        return f"meta.quant = {value!r}", with_header(blob, dump(h))
    qs = [n for n, e in h["tensors"].items() if "quant" in e]
    if not qs:  # a float file: add a quant attribute where none belongs
        name = rng.choice([n for n in h["tensors"] if n.endswith(".weight")])
        h["tensors"][name]["quant"] = {"scheme": "int8", "group_size": 64, "shape": h["tensors"][name]["shape"]}
        return f"tensor {name}: quant attr added", with_header(blob, dump(h))
    name = rng.choice(qs)
    q = h["tensors"][name]["quant"]
    key = rng.choice(["scheme", "group_size", "shape", "whole"])
    value = rng.choice({"scheme": ["int4", "int8", "int2", "int3", "bf16", "zz", 3],
                        "group_size": [0, -32, 16, 128, 7, "x", None],
                        "shape": [list(reversed(q["shape"])), [q["shape"][0], q["shape"][1] * 2], [1], "x"],
                        "whole": [None, "x", []]}[key])
    if key == "whole":
        h["tensors"][name]["quant"] = value
    else:
        q[key] = value
    return f"tensor {name}: quant.{key} = {value!r}", with_header(blob, dump(h))


GENERATORS = {"preamble": _preamble, "header_flip": _header_flip, "data_flip": _data_flip, "truncate": _truncate,
              "header_bytes": _header_bytes, "config": _config, "index": _index, "json": _json,
              "tokenizer": _tokenizer, "quant": _quant}


# ----------------------------------------------------------------------------- HF folders


def _st_split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_join(header: Any, data: bytes, raw_header: bytes | None = None) -> bytes:
    hb = raw_header if raw_header is not None else json.dumps(header, allow_nan=True).encode()
    return struct.pack("<Q", len(hb)) + hb + data


def hf_mutant(base: Path, out: Path, category: str, rng: random.Random) -> tuple[str, str, int]:
    """Copy `base` to `out`, mutate it; returns (description, --quant, --group-size)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    scheme, gs = rng.choice([("bf16", 64), ("int8", 64), ("int4", 32), ("f32", 64)])
    desc = HF_GENERATORS[category](out, rng)
    if desc.startswith("!group"):
        scheme, gs = "int4", int(desc.split()[1])
    return desc, scheme, gs


def _hf_config(folder: Path, rng: random.Random) -> str:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    kind = rng.random()
    if kind < 0.75:
        path = rng.choice(_config_paths(cfg))
        value = rng.choice(BAD_VALUES)
        _set(cfg, path, value)
        p.write_text(json.dumps(cfg, allow_nan=True))
        return f"config {'.'.join(path)} = {value!r}"
    raw = rng.choice([b"[1, 2]", b"", b"{", b"\xff\xfe\x00garbage", b"null", b'{"model_type": "llama"}',
                      b'{"model_type": 5}', b"[" * 100000 + b"]" * 100000])
    p.write_bytes(raw)
    return f"config.json = {raw[:20]!r}"


def _hf_safetensors(folder: Path, rng: random.Random) -> str:
    p = folder / "model.safetensors"
    h, data = _st_split(p)
    names = [n for n in h if n != "__metadata__"]
    name = rng.choice(names)
    e = h[name]
    kind = rng.choice(["shape", "reversed", "beyond", "notobj", "noshape", "nodtype", "dtype", "hugelen",
                       "shortlen", "utf8", "deep", "entry", "offsets", "negshape", "truncated", "overlap",
                       "f16"])
    raw_header = None
    if kind == "shape":
        e["shape"] = [d * 2 for d in e["shape"]] or [2]
    elif kind == "reversed":
        e["data_offsets"] = list(reversed(e["data_offsets"]))
    elif kind == "beyond":
        e["data_offsets"] = [e["data_offsets"][0], len(data) + 4096]
    elif kind == "notobj":
        raw_header = rng.choice([b"[]", b"5", b'"x"', b"null"])
    elif kind == "noshape":
        del e["shape"]
    elif kind == "nodtype":
        del e["dtype"]
    elif kind == "dtype":
        e["dtype"] = rng.choice(["X9", 5, None, "F8_E4M3", "BOOL", "I64"])
    elif kind == "hugelen":
        return _write(p, struct.pack("<Q", 2**62) + b"{}")
    elif kind == "shortlen":
        hb = json.dumps(h).encode()
        return _write(p, struct.pack("<Q", len(hb) // 2) + hb + data)
    elif kind == "utf8":
        raw_header = json.dumps(h).encode().replace(b'"dtype"', b'"dt\xffype"', 1)
    elif kind == "deep":
        raw_header = b"[" * 100000 + b"]" * 100000
    elif kind == "entry":
        h[name] = rng.choice([5, "x", [], None])
    elif kind == "offsets":
        e["data_offsets"] = rng.choice([[0], "x", [-8, 0], [0.5, 2], None])
    elif kind == "negshape":
        e["shape"] = [-1] + list(e["shape"][1:])
    elif kind == "truncated":
        return _write(p, _st_join(h, data[: rng.randrange(len(data))]))
    elif kind == "overlap":
        other = h[rng.choice(names)]
        e["data_offsets"] = list(other["data_offsets"])
    else:  # dtype changed to a same-size-per-2-bytes type: nbytes no longer match
        e["dtype"] = "F16" if e["dtype"] == "F32" else "F32"
    _write(p, _st_join(h, data, raw_header))
    return f"safetensors {kind} ({name})"


def _write(p: Path, blob: bytes) -> str:
    p.write_bytes(blob)
    return f"safetensors raw ({p.name})"


def _hf_tensors(folder: Path, rng: random.Random) -> str:
    import torch  # the worker has it; only this category rewrites tensor values
    from safetensors.torch import load_file, save_file

    p = folder / "model.safetensors"
    ts = load_file(str(p))
    names = sorted(ts)
    kind = rng.choice(["nan", "inf", "nan", "missing", "missing_expert", "extra", "group"])
    if kind in ("nan", "inf"):
        pick = rng.choice(["norm", "expert", "embed", "attn", "any"])
        pool = [n for n in names if {"norm": "norm", "expert": "experts", "embed": "embed", "attn": "self_attn",
                                     "any": ""}[pick] in n]
        name = rng.choice(pool)
        t = ts[name].clone()
        t.view(-1)[rng.randrange(t.numel())] = math.nan if kind == "nan" else -math.inf
        ts[name] = t
        desc = f"{kind} in {name}"
    elif kind == "missing":
        name = rng.choice(names)
        del ts[name]
        desc = f"missing {name}"
    elif kind == "missing_expert":
        name = rng.choice([n for n in names if ".experts." in n])
        del ts[name]
        desc = f"missing expert tensor {name}"
    elif kind == "extra":
        ts["model.layers.0.self_attn.extra.weight"] = torch.zeros(4, 4)
        desc = "extra tensor"
    else:
        return f"!group {rng.choice([48, 24, 40, 7])}"
    save_file(ts, str(p))
    return desc


def _hf_tokenizer(folder: Path, rng: random.Random) -> str:
    kind = rng.choice(["binary", "garbage", "notobj", "idhigh", "missing", "tcfg", "gencfg", "eos", "stm",
                       "template", "addedhigh"])
    tj = folder / "tokenizer.json"
    if kind == "binary":
        tj.write_bytes(bytes(rng.randrange(256) for _ in range(500)))
    elif kind == "garbage":
        tj.write_text(tj.read_text()[: rng.randrange(1, 2000)])
    elif kind == "notobj":
        tj.write_text(rng.choice(["[]", "5", "null", '{"model": 5}']))
    elif kind in ("idhigh", "addedhigh"):
        t = json.loads(tj.read_text())
        if kind == "idhigh":
            t["model"]["vocab"]["zzzz"] = rng.choice([10**6, 384, 2**31 - 1])
        else:
            t["added_tokens"].append({"id": 10**5, "content": "<x>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
        tj.write_text(json.dumps(t))
    elif kind == "missing":
        tj.unlink()
    elif kind == "tcfg":
        (folder / "tokenizer_config.json").write_text(rng.choice(["[]", "{", "5", '{"eos_token": 5}']))
    elif kind == "gencfg":
        (folder / "generation_config.json").write_text(rng.choice(["[]", "[1]", "{", '"x"']))
    elif kind == "eos":
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": rng.choice(["x", 10**9, -2,
                                                                                                [1, "y"]])}))
    elif kind == "stm":
        (folder / "special_tokens_map.json").write_text(rng.choice(["[]", "{"]))
    else:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = rng.choice([5, ["x"], "{% for %}"])
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return f"tokenizer {kind}"


HF_GENERATORS = {"hf_config": _hf_config, "hf_safetensors": _hf_safetensors, "hf_tensors": _hf_tensors,
                 "hf_tokenizer": _hf_tokenizer}
