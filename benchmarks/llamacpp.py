"""llama.cpp as a measured baseline: build it from PyPI's llama-cpp-python sdist, convert to GGUF, time it.

    from llamacpp import build, to_gguf, llama_bench, llama_server_cmd   # benchmarks/ on sys.path
    .venv/bin/python benchmarks/llamacpp.py [--cache /tmp/colibri-bench/llamacpp]   # build only

Shared by bench_vs_llamacpp.py, bench_serve.py and bench_capped.py, so every ratio to llama.cpp
is one measured in the same run (no figure is typed into a script). Steps, all cached in
`cache` and skipped when their output exists:
1. `pip download --no-binary :all: --no-deps llama-cpp-python` (the sdist vendors llama.cpp and
   its gguf-py), unpacked next to the tarball.
2. cmake with GGML_NATIVE=OFF and explicit AVX-512/VNNI/BF16 + AVX2/FMA/F16C flags, AMX OFF (AMX
   tile instructions fault on the reference VM, and -march=native would turn them on), then
   `nice -n 10 cmake --build -j2` of llama-bench, llama-completion, llama-simple, llama-server.
3. GGUF: the sdist's convert_hf_to_gguf.py (with its own gguf-py first on sys.path) writes the
   f16 GGUF, llama-quantize... is not needed: the converter writes q8_0 directly and llama-quantize
   makes Q4_0 from the f16 file (the converter has no q4_0 output type).
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
               "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF"]


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


def version(bin_dir: Path) -> str:
    p = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
    m = re.search(r"version: (\S+ \(\w+\))", p.stdout + p.stderr)
    return m[1] if m else "?"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    b = build(ap.parse_args().cache)
    print(json.dumps({"bin": str(b), "version": version(b)}))
    os._exit(0)
