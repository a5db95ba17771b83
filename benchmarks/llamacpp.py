"""llama.cpp as a measured baseline: build it from PyPI's llama-cpp-python sdist, convert to GGUF, time it.

    from llamacpp import build, to_gguf, bench_cmd, server_cmd   # with benchmarks/ on sys.path
    .venv/bin/python benchmarks/llamacpp.py [--cache /tmp/colibri-bench/llamacpp]   # build only

Shared by bench_vs_llamacpp.py and bench_serve.py, so every ratio to llama.cpp
is one measured in the same run (no figure is typed into a script). Steps, all cached in
`cache` and skipped when their output exists:
1. `pip download --no-binary :all: --no-deps llama-cpp-python` (the sdist vendors llama.cpp and
   its gguf-py), unpacked next to the tarball.
2. cmake with GGML_NATIVE=OFF and explicit AVX-512/VNNI/BF16 + AVX2/FMA/F16C flags, AMX OFF (AMX
   tile instructions fault on the reference VM, and -march=native would turn them on), then
   `nice -n 10 cmake --build -j2` of llama-bench, llama-completion, llama-simple, llama-server
   (without its web UI, which the build would fetch from the network) and llama-quantize.
3. GGUF: the sdist's convert_hf_to_gguf.py, with the sdist's own gguf-py first on sys.path,
   writes Q8_0 directly; Q4_0 is llama-quantize's from a bf16 GGUF (the converter has no q4_0
   output type; llama-quantize keeps output.weight at Q6_K, as it does for every Q4_0 model).
   The converter identifies a BPE pre-tokenizer by hashing the ids of a test string and refuses
   unknown ones, which every home-made test tokenizer is. `_CONVERT` relaxes that check by a
   monkeypatch at run time (the sdist is never edited): our tokenizers (tests/hf_tiny.py) are
   HF ByteLevel BPE with the default GPT-2 split regex, i.e. llama.cpp's "gpt-2" pre-tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_CACHE = Path("/tmp/colibri-bench/llamacpp")
TARGETS = ("llama-bench", "llama-completion", "llama-simple", "llama-server", "llama-quantize")
# Explicit ISA instead of GGML_NATIVE: -march=native would enable AMX on CPUs that report it,
# and AMX tile instructions fault on the reference VM.
CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
               "-DGGML_AVX512_VBMI=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
               "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               # llama-server without its web UI: the build would otherwise fetch it from the network
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]


def _log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def source(cache: Path = DEFAULT_CACHE) -> Path:
    """The vendored llama.cpp tree of the newest llama-cpp-python sdist (downloaded once)."""
    cache.mkdir(parents=True, exist_ok=True)
    tars = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not tars:
        _log(f"downloading the llama-cpp-python sdist into {cache}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "--quiet", "llama-cpp-python", "-d", str(cache)], check=True)
        tars = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    tar = tars[-1]
    top = cache / tar.name.removesuffix(".tar.gz")
    tree = top / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        _log(f"unpacking {tar.name}")
        with tarfile.open(tar) as t:
            t.extractall(cache, filter="data")
    return tree


def build(cache: Path = DEFAULT_CACHE) -> Path:
    """Build the llama.cpp tools once; returns the folder holding the binaries."""
    tree = source(cache)
    bdir = tree / "build-colibri"
    bin_dir = bdir / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    _log(f"building {', '.join(TARGETS)} in {bdir} (nice -n 10, -j2: ~20-40 min on 2 cores)")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(bdir), "-G", "Ninja", *CMAKE_FLAGS], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(bdir), "-j2", "--target", *TARGETS], check=True)
    return bin_dir


# Runs the sdist's converter as __main__ after one patch: unknown pre-tokenizer hash -> "gpt-2".
_CONVERT = """
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# Home-made test tokenizers (tokenizer.json only, none of GLM's special tokens): the plain BPE vocabulary
# where a family's converter wants a SentencePiece model (ERNIE) or GLM's [gMASK] & co.
base.TextModel._set_vocab_sentencepiece = base.TextModel._set_vocab_gpt2
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
try:  # (Hunyuan's converter reads a tiktoken vocabulary)
    from conversion import hunyuan
    hunyuan.HunYuanMoEModel.set_vocab = base.TextModel._set_vocab_gpt2
except (ImportError, AttributeError):
    pass
try:  # (Qwen3-Next's converter expects multi-token-prediction layers, which random checkpoints do not have)
    from conversion import qwen
    qwen.Qwen3NextModel.no_mtp = True
    qwen.Qwen3_5MoeTextModel.no_mtp = True
except (ImportError, AttributeError):
    pass
try:  # (Solar Open's converter looks up its own special tokens by name)
    from conversion import glm
    glm.SolarOpenModel.set_vocab = base.TextModel._set_vocab_gpt2
except (ImportError, AttributeError):
    pass
try:  # (Phi-3's and Phi-3.5-MoE's converters read a SentencePiece model unless told GPT-2)
    from conversion import phi
    phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2
except (ImportError, AttributeError):
    pass
try:  # (Gemma 4's converter wants a SentencePiece-style BPE with byte fallback)
    from conversion import gemma
    gemma.Gemma4Model.set_vocab = base.TextModel._set_vocab_gpt2
except (ImportError, AttributeError):
    pass
try:  # (Jamba's converter reads a SentencePiece model or Llama's tokenizer files)
    from conversion import jamba
    jamba.JambaModel.set_vocab = base.TextModel._set_vocab_gpt2
except (ImportError, AttributeError):
    pass
try:  # (Granite 4.0-H's converter finds attention layers by the releases' "attention"; transformers 5 saves them
    # as "full_attention")
    from conversion import granite
    _attn_layers = granite.GraniteHybridModel.get_attn_layers
    def _attn_layers_v5(self):
        kinds = self.hparams.get("layer_types") or []
        self.hparams["layer_types"] = ["attention" if k == "full_attention" else k for k in kinds]
        return _attn_layers(self)
    granite.GraniteHybridModel.get_attn_layers = _attn_layers_v5
except (ImportError, AttributeError):
    pass
try:  # (MiniMax-Text-01's converter reads the original checkpoint's config names and its tokenizer's remote code;
    # transformers' port saves its own names and the lightning layers' decay tables, which llama.cpp recomputes)
    from conversion import minimax
    _mm = minimax.MiniMaxText01Model
    _mm_params, _mm_tensors = _mm.set_gguf_parameters, _mm.modify_tensors
    def _mm_params_v5(self):
        h = self.hparams
        for kind, old in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp")):
            for w in ("alpha", "beta"):
                h.setdefault(f"layernorm_{old}_{w}", h.get(f"{kind}_{w}_factor", 1.0))
        h.setdefault("rotary_dim", h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"])
        return _mm_params(self)
    def _mm_tensors_v5(self, data, name, bid):
        if name.endswith(("slope_rate", "query_decay", "key_decay", "diagonal_decay")):
            return []
        return _mm_tensors(self, data, name, bid)
    _mm.set_gguf_parameters, _mm.modify_tensors = _mm_params_v5, _mm_tensors_v5
    _mm._get_suppress_tokens = lambda self: None
    base.ModelBase.register("MiniMaxForCausalLM")(_mm)
    import conversion
    conversion.TEXT_MODEL_MAP["MiniMaxForCausalLM"] = "minimax"
except (ImportError, AttributeError):
    pass
try:  # (Kimi-Linear's converter reads the released `linear_attn_config` and the config's own names; transformers
    # saves its flat fields)
    from conversion import kimi_linear
    _kl_params = kimi_linear.KimiLinearModel.set_gguf_parameters
    def _kl_params_v5(self):
        h = self.hparams
        if "linear_attn_config" not in h and h.get("layer_types"):
            kinds = h["layer_types"]
            h["linear_attn_config"] = {
                "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
                "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
                "head_dim": h.get("linear_head_dim", 128), "num_heads": h.get("linear_num_heads", 32),
                "short_conv_kernel_size": h.get("linear_conv_kernel_dim", 4)}
        h.setdefault("first_k_dense_replace", (h.get("mlp_layer_types") or ["dense"]).count("dense"))
        h.setdefault("moe_router_activation_func", "sigmoid")  # (as released; transformers' router is sigmoid)
        return _kl_params(self)
    kimi_linear.KimiLinearModel.set_gguf_parameters = _kl_params_v5
    _kl_tensors = kimi_linear.KimiLinearModel.modify_tensors
    def _kl_tensors_v5(self, data, name, bid):  # (the dense layers' MLP under the released `mlp.`)
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = name.replace(f".block_sparse_moe.{part}.", f".mlp.{part}.")
        return _kl_tensors(self, data, name, bid)
    kimi_linear.KimiLinearModel.modify_tensors = _kl_tensors_v5
except (ImportError, AttributeError):
    pass
try:  # (Ling 3.0: llama.cpp converts the release, BailingMoeV3ForCausalLM; transformers' port saves the release's
    # tensor names under its own architecture, with its flat config: the KDA width as linear_head_dim, no switches)
    from conversion import bailingmoe3
    _b3 = bailingmoe3.BailingMoeV3Model
    _b3_params = _b3.set_gguf_parameters
    def _b3_params_v5(self):
        h = self.hparams
        h.setdefault("no_kda_lora", True)
        h.setdefault("gated_attention_proj_granularity_type", "head_wise")
        h["head_dim"] = h.get("linear_head_dim", h["head_dim"])
        h.setdefault("short_conv_kernel_size", h.get("linear_conv_kernel_dim", 4))
        h.setdefault("moe_shared_expert_intermediate_size",
                     h["moe_intermediate_size"] * h.get("num_shared_experts", 1))
        h.setdefault("norm_topk_prob", h.get("moe_renormalize", True))
        h.setdefault("score_function", "sigmoid")  # (the port's router; the release's config names it)
        return _b3_params(self)
    _b3.set_gguf_parameters = _b3_params_v5
    base.ModelBase.register("BailingHybridForCausalLM")(_b3)
    import conversion
    conversion.TEXT_MODEL_MAP["BailingHybridForCausalLM"] = "bailingmoe3"
except (ImportError, AttributeError):
    pass
try:  # (MiniMax-M3: llama.cpp converts the release, MiniMaxM3SparseForCausalLM; transformers' text model saves its flat
    # config, `mlp` for `block_sparse_moe`, fused experts and dense gate_up_proj, the indexer under `indexer.`)
    from conversion import minimax as _m3mod
    _m3 = _m3mod.MiniMaxM3Model
    _m3_params, _m3_tensors = _m3.set_gguf_parameters, _m3.modify_tensors
    def _m3_params_v5(self):
        h = self.hparams
        h.setdefault("n_shared_experts", 1)
        h.setdefault("scoring_func", "sigmoid")  # (as released; transformers' router is sigmoid)
        h.setdefault("moe_layer_freq", [int(k == "sparse") for k in h["mlp_layer_types"]])
        h.setdefault("sparse_attention_config", {
            "sparse_num_index_heads": h["index_n_heads"], "sparse_index_dim": h["index_head_dim"],
            "sparse_topk_blocks": h["index_topk_blocks"], "sparse_block_size": h["index_block_size"],
            "sparse_local_block": h["index_local_blocks"]})
        return _m3_params(self)
    def _m3_tensors_v5(self, data, name, bid):
        for ours, theirs in (("self_attn.indexer.", "self_attn.index_"), ("mlp.gate.e_score_correction_bias",
                             "block_sparse_moe.e_score_correction_bias"), ("mlp.gate.", "block_sparse_moe.gate."),
                             ("mlp.shared_experts.", "block_sparse_moe.shared_experts."),
                             ("mlp.experts.", "block_sparse_moe.experts.")):
            name = name.replace(ours, theirs)
        parts = [(name, data)]
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> each expert's w1 (gate rows) and w3 (up rows)
            half, base = data.shape[1] // 2, name.removesuffix("gate_up_proj")
            parts = [(f"{base}{e}.{w}.weight", t[e]) for e in range(data.shape[0])
                     for w, t in (("w1", data[:, :half]), ("w3", data[:, half:]))]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            parts = [(f"{name.removesuffix('down_proj')}{e}.w2.weight", data[e]) for e in range(data.shape[0])]
        elif name.endswith("gate_up_proj.weight"):
            half = data.shape[0] // 2
            parts = [(name.replace("gate_up_proj", "gate_proj"), data[:half]),
                     (name.replace("gate_up_proj", "up_proj"), data[half:])]
        for n, t in parts:
            yield from _m3_tensors(self, t, n, bid)
    _m3.set_gguf_parameters, _m3.modify_tensors = _m3_params_v5, _m3_tensors_v5
    base.ModelBase.register("MiniMaxM3VLForCausalLM")(_m3)
    import conversion
    conversion.TEXT_MODEL_MAP["MiniMaxM3VLForCausalLM"] = "minimax"
except (ImportError, AttributeError):
    pass
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def to_gguf(hf: Path, out: Path, qtype: str, cache: Path = DEFAULT_CACHE) -> Path:
    """`hf` (a HF folder) as a GGUF of `qtype` ("q8_0" or "q4_0") at `out`, made once."""
    if out.exists():
        return out
    tree = source(cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tmp = out.with_name(out.name + ".tmp")
    if qtype == "q8_0":
        _log(f"converting {hf.name} -> {out.name}")
        subprocess.run([sys.executable, "-c", _CONVERT, str(tree), str(hf), "--outtype", "q8_0",
                        "--outfile", str(tmp)], check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    elif qtype == "q4_0":
        bf16 = to_gguf_bf16(hf, out.with_name(out.name.replace(".q4_0.", ".bf16.")), cache)
        _log(f"quantizing {bf16.name} -> {out.name}")
        subprocess.run([str(build(cache) / "llama-quantize"), str(bf16), str(tmp), "Q4_0", "2"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bf16.unlink()  # only a step to Q4_0: 2x the model's size on disk otherwise
    else:
        raise ValueError(f"unsupported GGUF type {qtype}")
    os.replace(tmp, out)
    return out


def to_gguf_bf16(hf: Path, out: Path, cache: Path = DEFAULT_CACHE) -> Path:
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        _log(f"converting {hf.name} -> {out.name}")
        subprocess.run([sys.executable, "-c", _CONVERT, str(source(cache)), str(hf), "--outtype", "bf16",
                        "--outfile", str(tmp)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(tmp, out)
    return out


def active_bytes(gguf: Path, top_k: int, n_experts: int, cache: Path = DEFAULT_CACHE) -> int:
    """Weight bytes one decode token reads from a GGUF: dense tensors, one embedding row, and
    top_k / n_experts of every stacked expert tensor ([n_experts, ...] in one GGUF tensor)."""
    sys.path.insert(0, str(source(cache) / "gguf-py"))
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(gguf).tensors:
        if t.name == "token_embd.weight":
            total += int(t.n_bytes) // int(t.shape[-1])  # one row; shape is [n_embd, n_vocab] (ggml order)
        elif "_exps." in t.name:
            total += int(t.n_bytes) * top_k // n_experts
        else:
            total += int(t.n_bytes)
    return total


def bench_cmd(bin_dir: Path, gguf: Path, threads: int, prompt_len: int, tokens: int, repeats: int,
              repack: bool = True) -> list[str]:
    """llama-bench: pp`prompt_len` and tg`tokens` (mmap on, its default), JSON on stdout.

    repack=False keeps the weights in the file mapping: by default llama.cpp copies Q4_0 weights
    into an interleaved layout in anonymous memory (peak RSS ~1.7x the file), which a memory cap
    smaller than the file cannot hold."""
    return [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_len),
            "-n", str(tokens), "-r", str(repeats), "-o", "json", "--repack", "1" if repack else "0"]


def parse_bench(stdout: str) -> dict:
    """llama-bench's JSON -> {"prefill_tok_s", "decode_tok_s"} (averages over its repeats)."""
    out = {}
    for r in json.loads(stdout):
        key = "prefill_tok_s" if r["n_gen"] == 0 else "decode_tok_s"
        out[key] = float(r["avg_ts"])
    return out


def server_cmd(bin_dir: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """llama-server with `slots` parallel sequences, each with `ctx_per_slot` positions."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
            "--no-webui", "--jinja"]


def version(bin_dir: Path) -> str:
    """The sdist's name and what llama-bench --version says (version, build number, commit)."""
    p = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
    m = re.search(r"version: (.+)", p.stdout + p.stderr)
    sdist = bin_dir.parents[3].name  # CACHE/<sdist>/vendor/llama.cpp/build-colibri/bin
    return f"{sdist}, llama.cpp {m[1].strip()}" if m else sdist


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    b = build(ap.parse_args().cache)
    print(json.dumps({"bin": str(b), "version": version(b)}))
