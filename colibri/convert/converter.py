"""Hugging Face safetensors folder -> one .coli container (`colibri convert`).

Tensors stream one at a time (pread -> sanitize -> quantize -> write), so peak RSS stays
near the largest tensor. Routed experts become one contiguous record each; per-expert and
fused `[E, ...]` checkpoints both work. The family's `sanitize()` owns name mapping.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import __version__
from ..errors import ColibriError
from ..format.container import Container, Writer
from ..format.validate import build_checked, check_config, check_sizes, check_tokenizer, layers_in, loads
from ..layers import mtp
from ..models.base import MULTIMODAL, expected_tensors, layer_of, multimodal_text, text_model_config
from ..models.family import Family, family
from ..progress import Progress
from ..quant import SCHEMES, can_quantize, layout, quantize
from . import tiktoken_bpe
from .safetensors_reader import SafetensorsFolder
from .source_quant import dequantizing

if TYPE_CHECKING:
    from .calibrate import ActivationStats

# Per-expert (`experts.3.w1.weight`) and fused (`experts.gate_up_proj`, leading [E]) names.
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# `_bias` (gpt-oss) and MXFP4 `_blocks`/`_scales` companions become parts "gate_up_bias", "down_blocks", ...
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<part>gate_up_proj|gate_proj|up_proj|down_proj)"
                    r"(?P<suffix>_bias|_blocks|_scales)?$")
_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
         "gate_up_proj": "gate_up"}
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _load_json(path: Path) -> dict:
    """A JSON object from a strict-JSON file (colibri/format/validate.py)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ColibriError(f"{path} not found") from None
    except OSError as e:
        raise ColibriError(f"cannot read {path}: {e.strerror or e}") from None
    out = loads(raw, str(path))
    if not isinstance(out, dict):
        raise ColibriError(f"{path} must hold a JSON object, not a {type(out).__name__}")
    return out


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse NaN/Inf weights (any float dtype, norms included): they convert fine and generate garbage."""
    if not t.is_floating_point():
        return
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), 1 << 22):  # chunked: the bool mask stays small for huge tensors
        if not torch.isfinite(flat[i : i + (1 << 22)]).all():
            raise ColibriError(f"{name}: the weights hold NaN or Inf values (a damaged checkpoint?): "
                               "refusing to convert")


def _num_experts(cfg: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def read_tokenizer(folder: Path, vocab_rows: int | None = None) -> dict:
    """What the container embeds of the tokenizer: tokenizer.json's text (or one made from a tiktoken.model,
    colibri/convert/tiktoken_bpe.py), its side files and the chat template."""
    out: dict = {}
    for extra in ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (folder / extra).exists():
            out[extra.removesuffix(".json")] = _load_json(folder / extra)
    tok = folder / "tokenizer.json"
    if not tok.exists() and (folder / tiktoken_bpe.FILE).exists():
        out["json"] = tiktoken_bpe.tokenizer_json(folder, out.get("tokenizer_config") or {}, vocab_rows)
    elif not tok.exists():
        raise ColibriError(f"no tokenizer.json in {folder}: colibri embeds the tokenizer in the container, "
                           "so copy tokenizer.json (and tokenizer_config.json) from the model's repository")
    else:
        try:
            out["json"] = tok.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ColibriError(f"{tok} is not utf-8 text ({e.reason} at byte {e.start}): a damaged download?") from None
        except OSError as e:
            raise ColibriError(f"cannot read {tok}: {e.strerror or e}") from None
    from ..chat_template import read_templates  # chat_template.jinja (current transformers) or the config's

    if (template := read_templates(folder, out.get("tokenizer_config"))) is not None:
        out.setdefault("tokenizer_config", {})["chat_template"] = template
    return out


class Plan:
    """Where each canonical tensor comes from and how it is stored."""

    def __init__(self, st: SafetensorsFolder, fam: Family, model_type: str, cfg: dict, scheme: str, group_size: int,
                 keep_mtp: bool = True):
        self.st, self.fam, self.scheme, self.group_size = st, fam, scheme, group_size
        model, _ = build_checked(model_type, cfg, "config.json")
        self.expected = expected_tensors(model)
        n_layers = cfg.get("num_hidden_layers", 0)
        # the MTP layers the container keeps (layers/mtp.py): where the family runs them and the checkpoint has
        # them (a config counts them where a repack stripped them), unless asked not to
        names = [n for hf in st.names() if (n := fam.sanitize(hf)) is not None]
        held = n_layers in {layer_of(n) for n in names} or any(n.startswith(mtp.PREFIX) for n in names)
        self.mtp = mtp.kept(model_type, cfg) if keep_mtp and held else 0
        self.expected.update(mtp.expected(model_type, cfg) if self.mtp else {})
        self.sources: dict[str, str] = {}  # canonical name -> HF name
        self.experts: dict[str, dict[tuple[int | None, str], str]] = {}  # prefix -> {(e|None, part): HF name}
        sanitize = fam.sanitize
        dropped = list(getattr(st, "hidden", ()))  # (what a family's source_view hides: ERNIE-4.5-VL's vision experts)
        # Multi-token-prediction heads (GLM-4.5, DeepSeek-V3, Hy3) ship as extra layers past the decoder stack.
        n_mtp = cfg.get("num_nextn_predict_layers") or fam.mtp_layers
        ignored = fam.ignored  # (names the family drops where its model has no such tensor)
        for hf in st.names():
            name = sanitize(hf)
            layer = None if name is None else layer_of(name)
            if layer is not None and n_layers <= layer < n_layers + n_mtp:
                rest = name.split(".", 3)[3]  # (after model.layers.{i}.)
                name = mtp.canonical(rest, layer - n_layers) if layer < n_layers + self.mtp else None
            if name is not None and name.startswith(mtp.PREFIX) and not self.mtp:  # (Qwen's layout, dropped)
                name = None
            if name is not None and ignored is not None and ignored.fullmatch(name) and name not in self.expected:
                name = None
            if name is None:
                dropped.append(hf)
                continue
            if m := _PER_EXPERT.match(name):
                self.experts.setdefault(m["prefix"], {})[(int(m["e"]), _PART[m["part"]])] = hf
            elif (m := _FUSED.match(name)) and m["prefix"] in self.expected:
                part = _PART[m["part"]] + (m["suffix"] or "")
                self.experts.setdefault(m["prefix"], {})[(None, part)] = hf
            else:
                self.sources[name] = hf
        self.dropped = dropped
        if "lm_head.weight" in self.expected and "lm_head.weight" not in self.sources:
            if "model.embed_tokens.weight" in self.sources and cfg.get("tie_word_embeddings", False):
                self.sources["lm_head.weight"] = self.sources["model.embed_tokens.weight"]
        if self.mtp and fam.mtp_model_norm and "model.norm.weight" in self.sources:
            for j in range(self.mtp):
                self.sources.setdefault(f"{mtp.PREFIX}{j}.norm.weight", self.sources["model.norm.weight"])
        self._check()

    def _check(self) -> None:
        want = {n for n, (kind, _) in self.expected.items() if kind != "experts"}
        missing = sorted(want - set(self.sources))
        extra = sorted(set(self.sources) - want)
        if missing and all(n.startswith(mtp.PREFIX) for n in missing):
            raise ColibriError(f"the checkpoint's multi-token-prediction layer lacks {len(missing)} tensors, e.g. "
                               f"{missing[:3]}: convert with --no-mtp to drop it")
        if missing:
            raise ColibriError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
        if extra:
            raise ColibriError(f"checkpoint has {len(extra)} tensors this family does not use, e.g. {extra[:3]}")
        for n, (kind, shape) in self.expected.items():
            if kind == "experts":
                if n not in self.experts:
                    raise ColibriError(f"checkpoint has no routed experts for {n}")
                self._check_experts(n, shape[0])
            elif self.st.shape(self.sources[n]) != shape:
                raise ColibriError(f"{self.sources[n]}: shape {self.st.shape(self.sources[n])}, "
                                   f"config implies {shape}")

    def _check_experts(self, prefix: str, n: int) -> None:
        """Every expert 0..n-1 has the same parts (per-expert tensors), fused ones hold n experts."""
        parts = self.experts[prefix]
        per = sorted({p for (e, p) in parts if e is not None})
        for (e, _), hf in parts.items():
            if e is None and (not self.st.shape(hf) or self.st.shape(hf)[0] != n):
                raise ColibriError(f"{hf}: shape {list(self.st.shape(hf))}, the config implies {n} experts first")
            if e is not None and e >= n:
                raise ColibriError(f"{hf}: expert {e}, but the config has {n} experts")
        for e in range(n):
            for p in per:
                if (e, p) not in parts:
                    raise ColibriError(f"checkpoint lacks expert {e}'s {p} weight ({prefix}.{e}.{p})")

    def storage(self, name: str, kind: str, shape: tuple[int, ...]) -> str:
        """The scheme a tensor is stored with (see docs/FORMAT.md, 'what stays at higher precision')."""
        s = self.scheme
        if kind == "param":
            return "f32"  # norms, routers, biases, sinks: tiny, and precision-critical
        float_s = s if s in FLOAT_DTYPES else "bf16"
        if kind == "embedding" or s in FLOAT_DTYPES:
            return float_s
        if name == "lm_head.weight" and s != "int8":
            s = "int8"  # the output projection is the most sensitive; llama.cpp keeps it >= 6 bits too
        if not can_quantize(shape, s, self.group_size):
            s = "int8"  # e.g. an input dim not divisible by the group size: reported by fallbacks()
        return s

    def fallbacks(self) -> dict[str, str]:
        """{weight name: why} for the linears stored as int8 instead of the group scheme asked for
        (routed experts once per layer, as `...experts.*.down.weight`). Written to the header
        (`quant_fallback`), printed by convert and `colibri inspect` (docs/QUANT.md)."""
        if self.scheme in FLOAT_DTYPES or self.scheme == "int8":
            return {}
        out = {}
        for name, (kind, shape) in self.expected.items():
            if kind == "experts":
                _, inter, hidden, rows = shape
                weights = {f"{name}.*.gate_up.weight": (rows * inter, hidden), f"{name}.*.down.weight": (hidden, inter)}
            elif kind == "linear" and name != "lm_head.weight":  # lm_head: int8 by policy, not a fallback
                weights = {name: shape}
            else:
                continue
            for wname, wshape in weights.items():
                if not can_quantize(wshape, self.scheme, self.group_size):
                    out[wname] = (f"int8: in_features {wshape[1]} is not a multiple of the group size "
                                  f"{self.group_size}" if wshape[1] % self.group_size else "int8: not byte-packable")
        return out

    def total_bytes(self) -> int:
        n = sum(self.st.nbytes(h) for h in self.sources.values())
        return n + sum(self.st.nbytes(h) for parts in self.experts.values() for h in parts.values())


def stored_tensors(name: str, w: torch.Tensor, scheme: str, group_size: int, stats=None,
                   full_name: str | None = None, grid: bool = False) -> dict[str, tuple[torch.Tensor, dict]]:
    """{stored name: (tensor, index attrs)} for one weight in `scheme` (quantized: data + companions).
    `stats` (calibrate.ActivationStats): group schemes use the importance-weighted quantizer. `grid`: the
    checkpoint was quantized already (groups on a grid of the scheme's levels are kept exactly)."""
    if scheme in FLOAT_DTYPES:
        return {name: (w.to(FLOAT_DTYPES[scheme]), {})}
    if stats is not None and scheme in ("int4", "int3", "int2"):
        from .calibrate import quantize_calibrated

        q = quantize_calibrated(w.float(), scheme, group_size, stats, full_name or name)
    else:
        q = quantize(w.float(), scheme, group_size, grid)
    attrs = {"quant": {"scheme": scheme, "group_size": group_size, "shape": list(w.shape)}}
    return {name + suffix: (t, attrs if not suffix else {}) for suffix, t in q.items()}


def _check_expert(prefix: str, e: int, record: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
    _, inter, hidden, rows = shape
    want = {"gate_up.weight": (rows * inter, hidden), "down.weight": (hidden, inter)}
    for part, expect in want.items():
        got = tuple(record[part].shape)
        if got != expect:
            raise ColibriError(f"{prefix}.{e}.{part}: shape {got}, config implies {expect}")


def _expert_parts(plan: Plan, prefix: str, e: int) -> dict[str, torch.Tensor]:
    parts = {}
    for (idx, part), hf in plan.experts[prefix].items():
        if idx == e:
            parts[part] = plan.st.read(hf)
        elif idx is None:
            parts[part] = plan.st.read(hf, index=e)
        else:
            continue
        check_finite(hf if idx is not None else f"{hf} (expert {e})", parts[part])
    return parts


def stats_for_convert(calibration, src: Path, group_size: int) -> ActivationStats:
    """`convert --calibration`: a saved statistics file (.safetensors), an `ActivationStats`, or a text
    file, for which the HF folder `src` is first converted to a temporary bf16 container (in TMPDIR)
    that colibri's engine then runs over the text."""
    from .calibrate import ActivationStats, gather

    if isinstance(calibration, ActivationStats):
        return calibration
    path = Path(calibration)
    if not path.is_file():
        raise ColibriError(f"calibration file {path} not found")
    if path.suffix == ".safetensors":
        return ActivationStats.load(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ColibriError(f"calibration file {path} is not UTF-8 text ({e})") from None
    tmp = Path(tempfile.mkdtemp(prefix="colibri-calib-"))
    try:
        print(f"calibration: converting {src.name} to a temporary bf16 container in {tmp}", file=sys.stderr)
        ref = convert(src, tmp / "bf16.coli", "bf16", group_size, progress=False)
        stats = gather(ref, text, threads=torch.get_num_threads())  # the caller's thread setting
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats.source = f"{path.name} ({stats.source})"
    return stats


def convert(src: str | Path, dst: str | Path, scheme: str = "bf16", group_size: int = 64,
            arch: str | None = None, progress: bool | None = None, calibration=None, keep_mtp: bool = True) -> Path:
    """Convert an HF folder into a verified container at `dst`; returns the path.


    `calibration`: a text file, a saved statistics file or a `calibrate.ActivationStats`; the
    int4/int3/int2 weights are then quantized with activation statistics (colibri/convert/calibrate.py).
    `keep_mtp`: keep the checkpoint's multi-token-prediction layers where the family runs them (layers/mtp.py;
    the drafts of `--spec mtp`); False drops them (`--no-mtp`), as the families that do not run them do."""
    src, dst = Path(src), Path(dst)
    if src.is_file():
        raise ColibriError(f"-i takes the model's folder (config.json, *.safetensors, tokenizer.json), not a file: "
                           f"use -i {src.parent}")
    if not src.is_dir():
        raise ColibriError(f"input folder {src} does not exist")
    if scheme not in SCHEMES:
        raise ColibriError(f"unknown --quant '{scheme}' (choose from {', '.join(SCHEMES)})")
    cfg = _load_json(src / "config.json")
    model_type = cfg.get("model_type")
    if not model_type:
        raise ColibriError(f"{src / 'config.json'} has no model_type")
    if model_type in MULTIMODAL and multimodal_text(cfg) is not None:  # multimodal: its text model
        cfg = text_model_config(cfg)
        model_type = cfg["model_type"]
    cfg = family(model_type).flat_config(cfg)  # a nested config (DBRX's) as the flat fields
    # Types and ranges of every value the family uses, and the family's own refusals (colibri/format/validate.py).
    fam = check_config(model_type, cfg, str(src / "config.json"))
    n_exp = _num_experts(cfg)
    if arch == "dense" and n_exp:
        raise ColibriError(f"--arch dense, but {src} is a Mixture-of-Experts checkpoint "
                           f"({model_type}, {n_exp} experts): use --arch moe")
    if arch == "moe" and not n_exp:
        raise ColibriError(f"--arch moe, but {src} is a dense checkpoint ({model_type}, no experts): "
                           "use --arch dense")
    tokenizer = read_tokenizer(src, cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None)
    tok_file = "tokenizer.json" if (src / "tokenizer.json").exists() else tiktoken_bpe.FILE
    check_tokenizer(tokenizer, cfg.get("vocab_size"), cfg, str(src / tok_file))
    st = SafetensorsFolder(src)
    st = fam.source_view(st, cfg)  # tensors split or reshaped as read (DBRX's)
    names = {n: m for n in st.names() if (m := fam.sanitize(n)) is not None}  # HF name -> canonical name
    embed = next((n for n, m in names.items() if m == "model.embed_tokens.weight"), None)
    check_sizes(cfg, st.shape(embed) if embed else None, layers_in(names.values()), str(src / "config.json"))
    st = dequantizing(st, cfg)  # a pre-quantized checkpoint (FP8 blocks, packed ints) reads back in float
    plan = Plan(st, fam, model_type, cfg, scheme, group_size, keep_mtp)
    meta = {"model_type": model_type, "config": cfg, "tokenizer": tokenizer,
            "quant": {"scheme": scheme, "group_size": group_size},
            "converter": {"colibri": __version__, "source": str(src), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                          "dropped": plan.dropped}}
    if fallback := plan.fallbacks():
        meta["quant"]["fallback_tensors"] = len(fallback)
        meta["quant_fallback"] = fallback
        print(f"warning: {len(fallback)} weights stored as int8, not {scheme} (e.g. {next(iter(fallback))}: "
              f"{next(iter(fallback.values()))}); `colibri inspect` lists them", file=sys.stderr)
    stats = None
    if calibration is not None:
        if scheme not in ("int4", "int3", "int2"):
            raise ColibriError(f"--calibration applies to --quant int4/int3/int2, not {scheme}")
        stats = stats_for_convert(calibration, src, group_size)
        meta["quant"]["calibration"] = stats.source or "uniform weights (no statistics)"
    grid = getattr(st, "integer_grid", False)  # (packed ints: keep groups that are on a grid exactly)
    with Progress(plan.total_bytes(), f"converting {src.name} -> {dst.name} ({scheme})", enabled=progress) as bar, \
            Writer(dst, meta) as w:
        for name, (kind, shape) in plan.expected.items():
            if kind == "experts":
                for e in range(shape[0]):
                    parts = _expert_parts(plan, name, e)
                    bar.update(sum(t.nbytes for t in parts.values()))
                    members: dict[str, tuple[torch.Tensor, dict]] = {}
                    try:
                        record = fam.expert_record(parts)
                    except KeyError as err:
                        raise ColibriError(f"checkpoint lacks the {err.args[0]} weight of expert {e} of "
                                           f"{name}") from None
                    _check_expert(name, e, record, shape)
                    for pname, t in record.items():
                        if pname.endswith(".bias"):
                            members[pname] = (t.float(), {})
                        else:
                            s = plan.storage(f"{name}.{e}.{pname}", "linear", tuple(t.shape))
                            members.update(stored_tensors(pname, t, s, group_size, stats, f"{name}.{e}.{pname}",
                                                          grid))
                    w.add_record(f"{name}.{e}", members)
                continue
            t = st.read(plan.sources[name])
            check_finite(plan.sources[name], t)
            t = fam.prepare(name, t, cfg)  # (a family's value remapping, e.g. ERNIE's interleaved RoPE rows)
            bar.update(t.nbytes)
            for sname, (data, attrs) in stored_tensors(name, t, plan.storage(name, kind, shape), group_size,
                                                       stats, grid=grid).items():
                w.add_tensor(sname, data, **attrs)
        if stats is not None and stats.unseen:  # e.g. a saved statistics file from another model
            w.meta["quant"]["uncalibrated"] = len(stats.unseen)
            print(f"warning: {len(stats.unseen)} weights had no calibration statistics and were quantized "
                  f"without them (e.g. {stats.unseen[0]})", file=sys.stderr)
    verify_converted(dst, plan)
    return dst


def expected_data_bytes(plan: Plan) -> int:
    """Tensor bytes the config implies under the storage policy (verify_converted checks the file against them)."""
    def nbytes(name: str, kind: str, shape: tuple[int, ...]) -> int:
        scheme = plan.storage(name, kind, shape)
        if kind != "linear":
            return prod(shape) * (4 if scheme == "f32" else 2)
        return sum(prod(s) * dt.itemsize for s, dt in layout(shape, scheme, plan.group_size).values())

    total = 0
    for name, (kind, shape) in plan.expected.items():
        if kind != "experts":
            total += nbytes(name, kind, shape)
            continue
        n_exp, inter, hidden, rows = shape
        per = nbytes(f"{name}.0.gate_up.weight", "linear", (rows * inter, hidden))
        per += nbytes(f"{name}.0.down.weight", "linear", (hidden, inter))
        total += n_exp * per
    return total


def verify_converted(path: Path, plan: Plan) -> None:
    """The converter's own check: checksums, every tensor the config implies present and shaped right,
    and the data size the config implies equal to what was written."""
    with Container(path) as c:
        c.verify()
        written = sum(c.info(n)["nbytes"] for n in c.names()
                      if not (c.info(n).get("record") and n.endswith(".bias")))  # expert biases: extra
        expected = expected_data_bytes(plan)
        if written != expected:
            raise ColibriError(f"verification failed: {path} holds {written} bytes of tensors, "
                               f"the config implies {expected}")
        for name, (kind, shape) in plan.expected.items():
            if kind == "experts":
                for e in range(shape[0]):
                    if not c.has_record(f"{name}.{e}"):
                        raise ColibriError(f"verification failed: expert record {name}.{e} missing in {path}")
                continue
            info = c.info(name)
            logical = tuple(info.get("quant", {}).get("shape", info["shape"]))
            if logical != shape:
                raise ColibriError(f"verification failed: {name} has shape {logical}, config implies {shape}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colibri convert", description="Convert a Hugging Face safetensors "
                                "checkpoint folder into a single .coli container.")
    p.add_argument("--input", "-i", required=True, help="HF model folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--output", "-o", required=True, help="output container path (.coli)")
    p.add_argument("--arch", choices=["moe", "dense"], help="expected architecture; refused if the checkpoint differs")
    p.add_argument("--quant", default="bf16", choices=SCHEMES,
                   help="weight format: f32/f16/bf16, int8 (per-channel), int4 (group-wise); int2/int3 experimental")
    p.add_argument("--group-size", type=int, default=64, help="group size for int4/int3/int2 (default 64)")
    p.add_argument("--calibration", metavar="FILE", help="int4/int3/int2: quantize with activation statistics "
                   "gathered by running the bf16 model over this text file (or a saved .safetensors statistics "
                   "file); see docs/QUANT.md")
    p.add_argument("--no-mtp", action="store_true", help="drop the checkpoint's multi-token-prediction layers "
                   "(kept by default where colibri runs them: DeepSeek-V3/V3.2, GLM-4.5/4.7/5, Qwen3-Next/3.5; "
                   "`--spec mtp` drafts with them)")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    a = p.parse_args(argv)
    if a.group_size <= 0 or a.group_size % 2:
        raise ColibriError("--group-size must be a positive even number")
    if a.quant in ("int2", "int3"):
        print(f"warning: --quant {a.quant} is experimental: expect a visible quality loss", file=sys.stderr)
    t0 = time.perf_counter()
    out = convert(a.input, a.output, a.quant, a.group_size, a.arch, progress=False if a.no_progress else None,
                  calibration=a.calibration, keep_mtp=not a.no_mtp)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {a.quant}) in {time.perf_counter() - t0:.1f}s; "
          "checksums and shapes verified", file=sys.stderr)
    return 0
