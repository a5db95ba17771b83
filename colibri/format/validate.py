"""The one place that decides whether a header, a config or a tokenizer can be trusted.

A `.coli` header and a Hugging Face folder are untrusted input: every value the engine later uses
is checked here, once, against sane ranges and against the tensor index, so that a damaged or
hostile file is refused with one `ColibriError` line at open (or at convert) instead of a
traceback, a hang or silently different output later. Used by `Container` (reader side) and by
`colibri convert` (before writing). docs/FORMAT.md, "What a reader accepts", lists the rules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ..errors import ColibriError

# Deeper than this is garbage, not a config (real headers nest ~5 levels).
MAX_DEPTH = 64
# Sizes past these are not models (and would allocate absurd skeletons before any check could run).
MAX_DIM = 1 << 24  # hidden / intermediate / head sizes
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 31

_POSITIVE = {
    "hidden_size": MAX_DIM, "intermediate_size": MAX_DIM, "moe_intermediate_size": MAX_DIM,
    "num_hidden_layers": 1 << 16, "num_attention_heads": 1 << 16, "num_key_value_heads": 1 << 16,
    "head_dim": MAX_DIM, "vocab_size": MAX_VOCAB, "max_position_embeddings": MAX_POSITIONS,
    "num_local_experts": MAX_EXPERTS, "num_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS,
    "kv_lora_rank": MAX_DIM, "q_lora_rank": MAX_DIM, "qk_rope_head_dim": MAX_DIM, "qk_nope_head_dim": MAX_DIM,
    "v_head_dim": MAX_DIM, "n_group": MAX_EXPERTS, "topk_group": MAX_EXPERTS, "moe_layer_freq": 1 << 16,
    "decoder_sparse_step": 1 << 16, "moe_topk": MAX_EXPERTS,
}  # fmt: skip
_NONNEG = {"n_routed_experts": MAX_EXPERTS, "n_shared_experts": MAX_EXPERTS, "first_k_dense_replace": 1 << 16,
           "shared_expert_intermediate_size": MAX_DIM, "num_nextn_predict_layers": 1 << 16,
           "num_shared_expert": MAX_EXPERTS}
_POSITIVE_FLOAT = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "swiglu_limit", "swiglu_alpha", "clip_qkv")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_FLOAT_CODES = ("f32", "f16", "bf16")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def fail(msg: str) -> ColibriError:
    return ColibriError(msg)


# ----------------------------------------------------------------------------- strict JSON


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (strict JSON)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:24]} does not fit a float")
    return v


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup[:60]!r}")
    return d


def loads(raw: bytes | str, what: str) -> Any:
    """Strict JSON (RFC 8259): no NaN/Infinity, no number overflowing a float, no duplicate keys,
    bounded nesting, utf-8. ColibriError `"{what} is not strict JSON: ..."` otherwise."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique)
    except UnicodeDecodeError as e:
        raise fail(f"{what} is not utf-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise fail(f"{what} is nested too deeply") from None
    except ValueError as e:
        raise fail(f"{what} is not strict JSON: {str(e)[:200]}") from None
    check_depth(obj, what)
    return obj


def check_depth(obj: Any, what: str, limit: int = MAX_DEPTH) -> None:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            raise fail(f"{what} is nested more than {limit} levels deep")
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if isinstance(v, dict | list))
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o if isinstance(v, dict | list))


# ----------------------------------------------------------------------------- scalars


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _int_field(cfg: Mapping, key: str, lo: int, hi: int, where: str) -> None:
    v = cfg.get(key)
    if v is None:
        return
    # (a non-empty list: one value per layer, as Hunyuan's configs write some; the family's field types below
    # refuse it where the family takes one value)
    if not all(is_int(x) and lo <= x <= hi for x in (v if isinstance(v, list) and v else [v])):
        raise fail(f"{where}: {key} = {_show(v)} must be an integer in [{lo}, {hi}] (or a list of them, one a layer)")


def _show(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, str | list | dict) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


# ----------------------------------------------------------------------------- config


_TYPE_CHECKS = {"int": is_int, "float": is_number, "bool": lambda v: isinstance(v, bool),
                "str": lambda v: isinstance(v, str), "list": lambda v: isinstance(v, list),
                "dict": lambda v: isinstance(v, dict), "None": lambda v: v is None}


def _annotation_ok(annotation: str, v: Any) -> bool:
    """Whether `v` fits a dataclass field's (string) annotation: int, float, bool, str, list, dict, None."""
    bases = [p.strip().split("[")[0] for p in annotation.split("|")]
    if any(b not in _TYPE_CHECKS for b in bases):
        return True  # a type this check does not know: no opinion
    return any(_TYPE_CHECKS[b](v) for b in bases)


def _rope(cfg: Mapping, where: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        r = cfg.get(key)
        if r is None:
            continue
        if not isinstance(r, dict):
            raise fail(f"{where}: {key} must be an object, got {_show(r)}")
        if r and all(isinstance(v, dict) or v is None for v in r.values()) \
                and any(isinstance(v, dict) for v in r.values()):  # one per layer type (MiMo-V2-Flash's)
            for kind, sub in r.items():  # (None: a kind without RoPE, Beam's full layers)
                if sub is not None:
                    _rope({key: sub}, f"{where}: {key}.{kind}")
            continue
        for k, v in r.items():
            if k in ("rope_type", "type"):
                if not isinstance(v, str):
                    raise fail(f"{where}: {key}.{k} must be a string, got {_show(v)}")
            elif k in ("truncate", "mrope_interleaved"):
                if not isinstance(v, bool):
                    raise fail(f"{where}: {key}.{k} must be true or false, got {_show(v)}")
            elif k == "mrope_section" or v is None:
                continue
            elif k in ("short_factor", "long_factor"):  # (longrope: one factor per frequency)
                if not isinstance(v, list) or not v or not all(is_number(f) and f > 0 for f in v):
                    raise fail(f"{where}: {key}.{k} must be a non-empty list of finite numbers > 0")
            elif not is_number(v) or v < 0 or (v == 0 and k in ("factor", "rope_theta")):
                raise fail(f"{where}: {key}.{k} = {_show(v)} must be a finite number > 0")
        if r.get("partial_rotary_factor") is not None and not 0 < r["partial_rotary_factor"] <= 1:
            raise fail(f"{where}: {key}.partial_rotary_factor must be in (0, 1]")


def check_config(model_type: Any, cfg: Any, where: str = "config") -> Any:
    """Types and ranges of every config value the family uses; returns the family (models/family.py).
    Refuses what would crash, hang or allocate absurdly later (before any skeleton is built)."""
    from ..models.family import family

    if not isinstance(model_type, str) or not model_type:
        raise fail(f"{where}: model_type must be a non-empty string, got {_show(model_type)}")
    fam = family(model_type)
    if not isinstance(cfg, dict):
        raise fail(f"{where} must be a JSON object, got {type(cfg).__name__}")
    check_depth(cfg, where)
    for key, hi in _POSITIVE.items():
        _int_field(cfg, key, 1, hi, where)
    for key, hi in _NONNEG.items():
        _int_field(cfg, key, 0, hi, where)
    # sliding_window: a window of 0 keys is no attention at all; 0 is tolerated only where it is unused.
    _int_field(cfg, "sliding_window", 0 if cfg.get("use_sliding_window") is False else 1, MAX_POSITIONS, where)
    for key in _POSITIVE_FLOAT:
        v = cfg.get(key)
        if v is not None and (not is_number(v) or v <= 0):
            raise fail(f"{where}: {key} = {_show(v)} must be a positive finite number")
    v = cfg.get("partial_rotary_factor")
    if v is not None and (not is_number(v) or not 0 < v <= 1):
        raise fail(f"{where}: partial_rotary_factor = {_show(v)} must be in (0, 1]")
    _rope(cfg, where)
    # Every field the family's ModelArgs reads (under its aliases too) must have its declared type.
    args = fam.args
    fields = {f.name: f for f in dataclasses.fields(args)}
    for k, v in cfg.items():
        name = args.aliases.get(k, k)
        f = fields.get(name)
        if f is None or name == "raw" or v is None or _annotation_ok(str(f.type), v):
            continue
        raise fail(f"{where}: {k} = {_show(v)} has the wrong type (expected {f.type})")
    if isinstance(cfg.get("mlp_only_layers"), list) and not all(is_int(i) for i in cfg["mlp_only_layers"]):
        raise fail(f"{where}: mlp_only_layers must be a list of integers")
    if isinstance(cfg.get("layer_types"), list) and not all(isinstance(t, str) for t in cfg["layer_types"]):
        raise fail(f"{where}: layer_types must be a list of strings")
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if cfg.get(key) is None and key in fields and fields[key].default is dataclasses.MISSING:
            raise fail(f"{where}: {key} is missing")
    experts = next((cfg[k] for k in _EXPERT_KEYS if cfg.get(k)), 0)
    top_k = cfg.get("num_experts_per_tok")
    if experts and top_k is not None and top_k > experts:
        raise fail(f"{where}: num_experts_per_tok = {top_k} exceeds the {experts} experts")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise fail(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if heads and cfg.get("head_dim") is None and (cfg.get("hidden_size") or 0) % heads and "kv_lora_rank" not in fields:
        raise fail(f"{where}: hidden_size {cfg.get('hidden_size')} is not a multiple of num_attention_heads {heads} "
                   "(and no head_dim is given)")
    if (n_group := cfg.get("n_group")) and experts and experts % n_group:
        raise fail(f"{where}: n_group {n_group} does not divide the {experts} experts")
    if (tg := cfg.get("topk_group")) and tg > (cfg.get("n_group") or 1):
        raise fail(f"{where}: topk_group {tg} exceeds n_group {cfg.get('n_group') or 1}")
    try:
        fam.check_config(cfg)  # the family's own refusals (activation, routing, rope type, ...)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise fail(f"{where}: {type(e).__name__}: {e}") from None
    return fam


def build_checked(model_type: str, cfg: dict, where: str = "config"):
    """`models.base.build` for a config `check_config` accepted; a value combination the family cannot
    build (e.g. a rope setting out of its domain) is one ColibriError, not a traceback."""
    from ..models.base import build

    try:
        return build(model_type, cfg)
    except ColibriError as e:
        raise fail(f"{where}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError,
            RuntimeError) as e:
        raise fail(f"{where}: cannot build a {model_type} model from it ({type(e).__name__}: {e})") from None


def layers_in(names: Any) -> int:
    """1 + the highest `model.layers.N.` index among `names` (0 when none)."""
    top = -1
    for n in names:
        if m := _LAYER.match(n):
            top = max(top, int(m.group(1)))
    return top + 1


def check_sizes(cfg: dict, embed_shape: tuple[int, ...] | None, n_layers: int, where: str = "config") -> None:
    """The config's sizes against what the file holds, before a skeleton of that size is built."""
    if embed_shape is not None and tuple(embed_shape) != (cfg.get("vocab_size"), cfg.get("hidden_size")):
        raise fail(f"{where}: vocab_size {cfg.get('vocab_size')} x hidden_size {cfg.get('hidden_size')} does not "
                   f"match the embedding's shape {list(embed_shape)}")
    if (cfg.get("num_hidden_layers") or 0) > n_layers:
        raise fail(f"{where}: num_hidden_layers is {cfg.get('num_hidden_layers')}, the file holds {n_layers} layers")


# ----------------------------------------------------------------------------- tokenizer


_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_ok(v: Any) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str))


def check_tokenizer(tok: Any, vocab_rows: int | None, config: Mapping | None = None, where: str = "tokenizer"):
    """The embedded tokenizer (`meta["tokenizer"]`, or what the converter is about to embed): parsed,
    its side files typed, every id (vocabulary, added tokens, eos) below `vocab_rows`. Returns the
    parsed `tokenizers.Tokenizer`."""
    from ..tokenizer import parse

    if not isinstance(tok, dict):
        raise fail(f"{where} must be an object, got {type(tok).__name__}")
    if not isinstance(tok.get("json"), str):
        raise fail(f"{where}: the tokenizer.json text is missing")
    for key in ("tokenizer_config", "generation_config", "special_tokens_map"):
        if key in tok and not isinstance(tok[key], dict):
            raise fail(f"{where}: {key} must be an object, got {type(tok[key]).__name__}")
    tcfg = tok.get("tokenizer_config", {})
    for k, v in tcfg.items():
        if k in _TOKEN_KEYS and not _token_ok(v):
            raise fail(f"{where}: tokenizer_config.{k} = {_show(v)} is not a token")
    tpl = tcfg.get("chat_template")
    if tpl is not None and not isinstance(tpl, str) and not (
            isinstance(tpl, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                          and isinstance(t.get("template"), str) for t in tpl)):
        raise fail(f"{where}: chat_template must be a string or a list of named templates")
    tk = parse(tok["json"])
    if vocab_rows is not None:
        ids = tk.get_vocab(with_added_tokens=True).values()
        top = max(ids, default=-1)
        if top >= vocab_rows:
            raise fail(f"{where}: token id {top} is outside the model's {vocab_rows}-row vocabulary")
    for src, d in (("generation_config", tok.get("generation_config", {})), ("config", config or {})):
        eos = d.get("eos_token_id")
        if eos is None:
            continue
        for i in eos if isinstance(eos, list) else [eos]:
            if not is_int(i) or i < 0 or (vocab_rows is not None and i >= vocab_rows):
                raise fail(f"{where}: {src}.eos_token_id {_show(eos)} is not a token id of the "
                           f"{vocab_rows}-row vocabulary")
    return tk


# ----------------------------------------------------------------------------- a model container


def _storage(name: str, e: Any, shape: tuple[int, ...], kind: str, float_code: str, lookup) -> None:
    """One weight the model binds: its entry, dtype, logical shape and, when quantized, its companions."""
    from ..quant import SCHEMES, layout

    if e is None:
        raise fail(f"tensor {name} is missing")
    q = e.get("quant")
    if q is None:
        want = "f32" if kind == "param" else float_code
        if e["dtype"] != want or tuple(e["shape"]) != shape:
            raise fail(f"tensor {name}: {e['dtype']} {e['shape']}, the model expects {want} {list(shape)}")
        return
    if kind != "linear":
        raise fail(f"tensor {name}: a {kind} cannot be quantized")
    if not isinstance(q, dict):
        raise fail(f"tensor {name}: quant must be an object, got {_show(q)}")
    scheme, gs, qshape = q.get("scheme"), q.get("group_size"), q.get("shape")
    if scheme not in SCHEMES or scheme in _FLOAT_CODES:
        raise fail(f"tensor {name}: unknown quant scheme {_show(scheme)}")
    if not is_int(gs) or gs <= 0:
        raise fail(f"tensor {name}: quant group_size {_show(gs)} must be a positive integer")
    if qshape != list(shape):
        raise fail(f"tensor {name}: quant shape {_show(qshape)}, the model expects {list(shape)}")
    try:
        lay = layout(shape, scheme, gs)
    except ValueError as err:
        raise fail(f"tensor {name}: {err}") from None
    from .layout import DTYPE_CODES

    for suffix, (shp, dt) in lay.items():
        t = e if suffix == "" else lookup(name + suffix)
        if t is None or t["dtype"] != DTYPE_CODES[dt] or tuple(t["shape"]) != shp:
            got = "missing" if t is None else f"{t['dtype']} {t['shape']}"
            raise fail(f"tensor {name}{suffix}: {got}, {scheme} needs {DTYPE_CODES[dt]} {list(shp)}")


def check_model(meta: dict, tensors: dict, records: dict) -> None:
    """A model container's meta (model_type, config, quant, tokenizer) against its own tensor index."""
    from ..models.base import expected_tensors
    from ..quant import SCHEMES

    q = meta.get("quant", {})
    if not isinstance(q, dict):
        raise fail(f"meta.quant must be an object, got {_show(q)}")
    scheme = q.get("scheme", "bf16")
    if scheme not in SCHEMES:
        raise fail(f"meta.quant.scheme {_show(scheme)} is not one of {', '.join(SCHEMES)}")
    if "group_size" in q and (not is_int(q["group_size"]) or q["group_size"] <= 0):
        raise fail(f"meta.quant.group_size {_show(q['group_size'])} must be a positive integer")
    model_type, cfg = meta.get("model_type"), meta.get("config")
    check_config(model_type, cfg)
    embed = tensors.get("model.embed_tokens.weight")
    check_sizes(cfg, None if embed is None else tuple(embed["shape"]), layers_in(tensors))
    model, _ = build_checked(model_type, cfg)
    n_layers = len(model.model.layers)
    if layers_in(tensors) != n_layers:
        raise fail(f"config: num_hidden_layers is {n_layers}, the file holds {layers_in(tensors)} layers")
    float_code = scheme if scheme in _FLOAT_CODES else "bf16"
    for name, (kind, shape) in expected_tensors(model).items():
        if kind != "experts":
            _storage(name, tensors.get(name), shape, kind, float_code, tensors.get)
            continue
        n_exp, inter, hidden, rows = shape
        for e in range(n_exp):
            rec = records.get(f"{name}.{e}")
            if rec is None:
                raise fail(f"expert record {name}.{e} is missing")
            members = rec["tensors"]

            def member(full: str, members=members, prefix=f"{name}.{e}.") -> dict | None:
                return tensors.get(members[full[len(prefix):]]) if full[len(prefix):] in members else None

            for part, pshape in (("gate_up.weight", (rows * inter, hidden)), ("down.weight", (hidden, inter))):
                full = f"{name}.{e}.{part}"
                _storage(full, member(full), pshape, "linear", float_code, member)
            for part, size in (("gate_up.bias", rows * inter), ("down.bias", hidden)):
                b = member(f"{name}.{e}.{part}")
                if b is not None and (b["dtype"] != "f32" or b["shape"] != [size]):
                    raise fail(f"tensor {name}.{e}.{part}: {b['dtype']} {b['shape']}, the model expects f32 [{size}]")
    tok = meta.get("tokenizer")
    if tok is None:
        raise fail("the container has no embedded tokenizer")
    check_tokenizer(tok, model.model.embed_tokens.num_embeddings, cfg, "meta.tokenizer")


# ----------------------------------------------------------------------------- the index


def check_index(h: Any, version: int, data_end: int) -> None:
    """The header's structure and tensor index (docs/FORMAT.md, "Validation a reader must perform"):
    every tensor a known dtype and shape whose bytes lie in the data region, records whose members
    are packed inside them, and no two tensors or records sharing bytes."""
    from .layout import ALIGN, DTYPES, ITEMSIZE, MEMBER_ALIGN, PREAMBLE_SIZE

    if not isinstance(h, dict) or h.get("format") != "colibri":
        raise fail("header is not a colibri header")
    if h.get("version") != version:
        raise fail(f"header version {_show(h.get('version'))} disagrees with preamble version {version}")
    for key in ("meta", "tensors", "records"):
        if not isinstance(h.get(key), dict):
            raise fail(f"header field {key!r} is missing or not an object")
    check_depth(h["meta"], "meta")
    tensors, records = h["tensors"], h["records"]
    for name, e in tensors.items():
        if not isinstance(e, dict):
            raise fail(f"tensor {name}: entry is not an object")
        dt, shape, off, nb = e.get("dtype"), e.get("shape"), e.get("offset"), e.get("nbytes")
        if dt not in DTYPES:
            raise fail(f"tensor {name}: unknown dtype {_show(dt)}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise fail(f"tensor {name}: invalid shape {_show(shape)}")
        if not (is_int(off) and is_int(nb)):
            raise fail(f"tensor {name}: offset and nbytes must be integers")
        _checksums(e, f"tensor {name}", required=True)
        if off < PREAMBLE_SIZE or nb < 0 or off + nb > data_end:
            raise fail(f"tensor {name}: data [{off}, {off + nb}) outside the data region [{PREAMBLE_SIZE}, {data_end})")
        if off % MEMBER_ALIGN:
            raise fail(f"tensor {name}: offset {off} is not {MEMBER_ALIGN}-byte aligned")
        if nb != math.prod(shape) * ITEMSIZE[dt]:
            raise fail(f"tensor {name}: {nb} bytes do not match {dt} shape {shape}")
        if "record" in e and not (isinstance(e["record"], str) and e["record"] in records):
            raise fail(f"tensor {name}: record {_show(e['record'])} is not in the record index")
        if "record" not in e and nb and off % ALIGN:
            raise fail(f"tensor {name}: a standalone tensor's offset {off} is not {ALIGN}-byte aligned")
    spans: list[tuple[int, int, str]] = [(e["offset"], e["offset"] + e["nbytes"], n) for n, e in tensors.items()
                                         if "record" not in e and e["nbytes"]]
    for name, r in records.items():
        if not isinstance(r, dict) or not isinstance(r.get("tensors"), dict) or not r["tensors"]:
            raise fail(f"record {name}: entry is malformed")
        off, nb = r.get("offset"), r.get("nbytes")
        if not (is_int(off) and is_int(nb)) or not PREAMBLE_SIZE <= off <= off + nb <= data_end:
            raise fail(f"record {name}: range outside the data region")
        if off % ALIGN:
            raise fail(f"record {name}: offset {off} is not {ALIGN}-byte aligned")
        _checksums(r, f"record {name}", required=False)
        members = []
        for sub, full in r["tensors"].items():
            t = tensors.get(full) if isinstance(full, str) else None
            if t is None:
                raise fail(f"record {name}: member {sub!r} names unknown tensor {_show(full)}")
            if t["offset"] < off or t["offset"] + t["nbytes"] > off + nb:
                raise fail(f"record {name}: member {full} lies outside the record")
            if t.get("record") != name:
                raise fail(f"record {name}: member {full} does not name this record")
            members.append((t["offset"], t["offset"] + t["nbytes"], full))
        members.sort()
        # Members are packed from the record's start to its end (FORMAT.md, "Record entry").
        if members[0][0] != off or max(m[1] for m in members) != off + nb:
            raise fail(f"record {name}: members do not span [{off}, {off + nb}) exactly")
        _disjoint(members, f"record {name}: members")
        spans.append((off, off + nb, name))
    spans.sort()
    _disjoint(spans, "tensors")


def _checksums(e: dict, what: str, required: bool) -> None:
    """crc32c / crc32 (colibri/format/integrity.py): each present one a u32; a tensor carries at least one."""
    from .integrity import KEYS

    present = [k for k in KEYS if k in e]
    for k in present:
        if not is_int(e[k]) or not 0 <= e[k] < 1 << 32:
            raise fail(f"{what}: {k} {_show(e[k])} is not a 32-bit checksum")
    if required and not present:
        raise fail(f"{what}: no checksum ({' or '.join(KEYS)})")


def _disjoint(spans: list[tuple[int, int, str]], what: str) -> None:
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise fail(f"{what} {a} and {b} overlap")
