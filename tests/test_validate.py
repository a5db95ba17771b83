"""Header validation (colibri/format/validate.py): each hostile rewrite of a valid container is refused at open
with one ContainerError naming the problem; each hostile HF folder is refused by `convert` before
anything is written. The base files are tiny models the tests build (tests/hf_tiny.py)."""

from __future__ import annotations

import json
import math
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from colibri.convert.converter import convert
from colibri.errors import ColibriError, ContainerError
from colibri.format.container import Container
from colibri.format.validate import check_config, loads

PRE = struct.Struct("<8sIIQQIQ")


def split(blob: bytes) -> dict:
    _, _, _, h_off, h_len, _, _ = PRE.unpack_from(blob)
    return json.loads(blob[h_off : h_off + h_len])


def rewrite(blob: bytes, header: bytes) -> bytes:
    """`blob` with its JSON header replaced and the preamble fixed up (a hostile writer's file)."""
    magic, version, flags, h_off, _, _, _ = PRE.unpack_from(blob)
    pre = PRE.pack(magic, version, flags, h_off, len(header), zlib.crc32(header), h_off + len(header))
    return pre + blob[len(pre) : h_off] + header


def dump(h) -> bytes:
    return json.dumps(h, allow_nan=True).encode()


@pytest.fixture(scope="module")
def base(ckpt) -> dict[str, bytes]:
    return {s: Path(ckpt.coli("mixtral", s)).read_bytes() for s in ("bf16", "int4")}


def refused(tmp_path: Path, blob: bytes, *needles: str) -> str:
    p = tmp_path / "m.coli"
    p.write_bytes(blob)
    with pytest.raises(ContainerError) as e:
        Container(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    for n in needles:
        assert n in msg, msg
    return msg


def cfg_case(key, value):
    def mutate(h):
        h["meta"]["config"][key] = value
    return mutate


def _set(path, value):
    def mutate(h):
        d = h
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return mutate


def _expert(h) -> str:
    return next(n for n in h["tensors"] if ".experts.0.gate_up.weight" in n and n.endswith("weight"))


def _quant_shape(h):
    e = h["tensors"][_expert(h)]
    e["quant"]["shape"] = list(reversed(e["quant"]["shape"]))


def _norm_quant(h):
    h["tensors"]["model.norm.weight"]["quant"] = {"scheme": "int8", "group_size": 64, "shape": [64]}


def _overlap(h):
    names = [n for n, e in h["tensors"].items() if "record" not in e]
    h["tensors"][names[1]]["offset"] = h["tensors"][names[0]]["offset"]


def _record_shrunk(h):
    r = next(iter(h["records"].values()))
    r["nbytes"] -= 64


def _tokenizer_id_high(h):
    t = json.loads(h["meta"]["tokenizer"]["json"])
    t["model"]["vocab"]["zzzz"] = 100000
    h["meta"]["tokenizer"]["json"] = json.dumps(t)


CASES = [
    ("layers huge", cfg_case("num_hidden_layers", 10**9), ["num_hidden_layers"]),
    ("layers fewer", cfg_case("num_hidden_layers", 1), ["num_hidden_layers is 1"]),
    ("top_k > experts", cfg_case("num_experts_per_tok", 9), ["num_experts_per_tok"]),
    ("top_k 0", cfg_case("num_experts_per_tok", 0), ["num_experts_per_tok"]),
    ("top_k negative", cfg_case("num_experts_per_tok", -1), ["num_experts_per_tok"]),
    ("experts fewer", cfg_case("num_local_experts", 2), ["mlp.gate.weight"]),
    ("sliding_window 0", cfg_case("sliding_window", 0), ["sliding_window"]),
    ("sliding_window negative", cfg_case("sliding_window", -4), ["sliding_window"]),
    ("rope_theta 0", cfg_case("rope_theta", 0), ["rope_theta"]),
    ("rope_theta string", cfg_case("rope_theta", "1e4"), ["rope_theta"]),
    ("rms_norm_eps negative", cfg_case("rms_norm_eps", -1e-5), ["rms_norm_eps"]),
    ("hidden_size float", cfg_case("hidden_size", 1.5), ["hidden_size"]),
    ("hidden_size wrong", cfg_case("hidden_size", 32), ["embedding"]),
    ("hidden_size bool", cfg_case("hidden_size", True), ["hidden_size"]),
    ("heads zero", cfg_case("num_attention_heads", 0), ["num_attention_heads"]),
    ("heads not dividing", cfg_case("num_key_value_heads", 3), ["num_key_value_heads"]),
    ("vocab vs embedding", cfg_case("vocab_size", 100), ["vocab_size"]),
    ("rope_scaling list", cfg_case("rope_scaling", {"rope_type": ["yarn"], "factor": 2.0}), ["rope_type"]),
    ("rope factor nan", cfg_case("rope_scaling", {"rope_type": "linear", "factor": -2}), ["factor"]),
    ("config list", _set(("meta", "config"), [1, 2]), ["config"]),
    ("model_type unknown", _set(("meta", "model_type"), "gpt2"), ["gpt2"]),
    ("model_type number", _set(("meta", "model_type"), 5), ["model_type"]),
    ("quant meta list", _set(("meta", "quant"), []), ["meta.quant"]),
    ("quant scheme unknown", _set(("meta", "quant", "scheme"), "int9"), ["int9"]),
    ("quant scheme float lie", _set(("meta", "quant", "scheme"), "f32"), ["the model expects f32"]),
    ("tensor quant shape", _quant_shape, ["quant shape"]),
    ("quant on a norm", _norm_quant, ["cannot be quantized"]),
    ("overlapping tensors", _overlap, ["overlap"]),
    ("record shrunk", _record_shrunk, ["record"]),
    ("tokenizer garbage", _set(("meta", "tokenizer", "json"), '{"model": {"type": "BPE", "vocab": "x"}}'),
     ["tokenizer does not load"]),
    ("tokenizer missing", _set(("meta", "tokenizer"), None), ["tokenizer"]),
    ("tokenizer id >= vocab", _tokenizer_id_high, ["token id 100000"]),
    ("generation_config list", _set(("meta", "tokenizer", "generation_config"), [1, 2]), ["generation_config"]),
    ("eos out of range", _set(("meta", "tokenizer", "generation_config"), {"eos_token_id": 10**6}), ["eos_token_id"]),
    ("eos token not a token", _set(("meta", "tokenizer", "tokenizer_config", "eos_token"), {"content": 5}),
     ["eos_token"]),
    ("chat_template number", _set(("meta", "tokenizer", "tokenizer_config", "chat_template"), 5), ["chat_template"]),
    ("crc not a number", lambda h: h["tensors"]["model.norm.weight"].update(crc32c="x", crc32="x"), ["checksum"]),
]


@pytest.mark.parametrize("name,mutate,needles", CASES, ids=[c[0] for c in CASES])
def test_rewritten_header_is_refused(base, tmp_path, name, mutate, needles):
    blob = base["int4" if "quant shape" in name else "bf16"]
    h = split(blob)
    mutate(h)
    refused(tmp_path, rewrite(blob, dump(h)), *needles)


@pytest.mark.parametrize("raw,needle", [
    (b'{"a": NaN}', "NaN"), (b'{"a": Infinity}', "Infinity"), (b'{"a": 1e400}', "1e400"),
    (b'{"a": 1, "a": 2}', "duplicate key"), (b"[" * 5000 + b"]" * 5000, "nested"),
    (b"[" * 100 + b"]" * 100, "nested more than"), (b'{"a": "\xff"}', "utf-8"), (b"\xef\xbb\xbf{}", "strict JSON"),
])
def test_strict_json(raw, needle):
    with pytest.raises(ColibriError, match=needle):
        loads(raw, "header")


@pytest.mark.parametrize("kind", ["nan", "inf", "deep", "dup", "bignum"])
def test_non_strict_header_is_refused(base, tmp_path, kind):
    blob = base["bf16"]
    h = split(blob)
    raw = dump(h)
    if kind == "nan":
        h["meta"]["config"]["rms_norm_eps"] = math.nan
        raw = dump(h)
    elif kind == "inf":
        h["meta"]["config"]["hidden_size"] = math.inf
        raw = dump(h)
    elif kind == "deep":
        h["meta"]["config"]["x"] = "@@"
        raw = dump(h).replace(b'"@@"', b"[" * 200000 + b"]" * 200000)
    elif kind == "dup":
        raw = raw[:-1] + b', "meta": {}}'
    else:
        h["meta"]["config"]["hidden_size"] = "@@"
        raw = dump(h).replace(b'"@@"', b"1e400")
    refused(tmp_path, rewrite(blob, raw), "header")


def test_valid_files_and_ignored_keys_are_accepted(base, tmp_path):
    """Unknown meta keys, unknown config keys and extra tensor attributes are ignored (FORMAT.md)."""
    for blob in base.values():
        h = split(blob)
        h["meta"]["brand_new"] = {"x": [1, 2]}
        h["meta"]["config"]["brand_new_key"] = "whatever"
        h["tensors"]["model.norm.weight"]["extra"] = {"deep": [1, {"x": None}]}
        p = tmp_path / "ok.coli"
        p.write_bytes(rewrite(blob, dump(h)))
        with Container(p, verify=True) as c:
            assert c.meta["brand_new"] == {"x": [1, 2]}


def test_config_checks_name_the_field():
    good = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 100}
    check_config("mixtral", good)
    for key, value in [("hidden_size", -1), ("hidden_size", "64"), ("num_attention_heads", 0),
                       ("num_experts_per_tok", 5), ("rms_norm_eps", 0.0), ("max_position_embeddings", 2**40)]:
        with pytest.raises(ColibriError, match=key):
            check_config("mixtral", {**good, key: value})
    with pytest.raises(ColibriError, match="JSON object"):
        check_config("mixtral", [good])


# ----------------------------------------------------------------------------- convert side


@pytest.fixture()
def hf(ckpt, tmp_path) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(ckpt.hf("mixtral"), out)
    return out


def _st(hf: Path) -> tuple[dict, bytes]:
    raw = (hf / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_write(hf: Path, header, data: bytes, raw: bytes | None = None) -> None:
    hb = raw if raw is not None else json.dumps(header).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def convert_refused(hf: Path, tmp_path: Path, *needles: str, scheme: str = "bf16") -> None:
    out = tmp_path / "out.coli"
    with pytest.raises(ColibriError) as e:
        convert(hf, out, scheme, 32, progress=False)
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)
    assert not out.exists()


@pytest.mark.parametrize("kind,needle", [("shape", "needs"), ("reversed", "data_offsets"), ("noshape", "shape"),
                                         ("notobj", "not a JSON object"), ("overlap", "data_offsets start at"),
                                         ("truncated", "data_offsets")])
def test_safetensors_header_checks(hf, tmp_path, kind, needle):
    h, data = _st(hf)
    name = next(n for n in h if n.endswith("experts.0.w1.weight"))
    e = h[name]
    raw = None
    if kind == "shape":
        e["shape"] = [d * 2 for d in e["shape"]]
    elif kind == "reversed":
        e["data_offsets"] = list(reversed(e["data_offsets"]))
    elif kind == "notobj":
        raw = b"[]"
    elif kind == "noshape":
        del e["shape"]
    elif kind == "overlap":
        other = next(n for n in h if n.endswith("experts.1.w1.weight"))
        e["data_offsets"] = list(h[other]["data_offsets"])
    else:
        data = data[: len(data) // 2]
    _st_write(hf, h, data, raw)
    convert_refused(hf, tmp_path, needle)


@pytest.mark.parametrize("target,scheme", [("model.norm.weight", "bf16"), ("input_layernorm", "int8"),
                                           ("experts.1.w2", "int4"), ("embed_tokens", "f32")])
def test_non_finite_weights_are_refused(hf, tmp_path, target, scheme):
    from safetensors.torch import load_file, save_file

    ts = load_file(str(hf / "model.safetensors"))
    name = next(n for n in sorted(ts) if target in n)
    t = ts[name].clone()
    t.view(-1)[3] = math.nan if scheme != "int4" else -math.inf
    ts[name] = t
    save_file(ts, str(hf / "model.safetensors"))
    convert_refused(hf, tmp_path, name, "NaN or Inf", scheme=scheme)


def test_missing_expert_names_it(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    ts = load_file(str(hf / "model.safetensors"))
    name = next(n for n in sorted(ts) if "layers.1" in n and "experts.2.w2" in n)
    del ts[name]
    save_file(ts, str(hf / "model.safetensors"))
    convert_refused(hf, tmp_path, "expert 2", "down")


@pytest.mark.parametrize("file,content,needle", [
    ("tokenizer.json", bytes(range(256)) * 2, "utf-8"),
    ("tokenizer.json", b'{"model": 5}', "tokenizer"),
    ("generation_config.json", b"[1]", "JSON object"),
    ("tokenizer_config.json", b"{", "strict JSON"),
    ("config.json", b"[1, 2]", "JSON object"),
    ("config.json", b"[" * 100000 + b"]" * 100000, "nested"),
    ("config.json", b'{"model_type": "mixtral", "hidden_size": NaN}', "NaN"),
])
def test_hf_side_files(hf, tmp_path, file, content, needle):
    (hf / file).write_bytes(content)
    convert_refused(hf, tmp_path, needle)


@pytest.mark.parametrize("key,value", [("hidden_size", -1), ("hidden_size", 0), ("hidden_size", "64"),
                                       ("num_attention_heads", 0), ("num_hidden_layers", 10**9),
                                       ("num_experts_per_tok", 0)])
def test_hf_config_values(hf, tmp_path, key, value):
    cfg = json.loads((hf / "config.json").read_text())
    cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    convert_refused(hf, tmp_path, key)


def test_tokenizer_ids_beyond_the_vocabulary(hf, tmp_path):
    t = json.loads((hf / "tokenizer.json").read_text())
    t["added_tokens"].append({"id": 10**5, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True})
    (hf / "tokenizer.json").write_text(json.dumps(t))
    convert_refused(hf, tmp_path, "token id", "outside the model's")


def test_tokenizer_parsed_once(base, tmp_path):
    """The Engine reuses the tokenizer the open-time check parsed (no second parse of a big vocabulary)."""
    from colibri import tokenizer

    p = tmp_path / "m.coli"
    p.write_bytes(base["bf16"])
    tokenizer.parse.cache_clear()
    with Container(p) as c:
        tk = tokenizer.Tokenizer(c.meta["tokenizer"], c.config)
    assert tokenizer.parse.cache_info().hits == 1 and isinstance(tk.encode("hi"), list)
