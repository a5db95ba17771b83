"""Every flag mistake: a non-zero exit, exactly one stderr line starting `colibri: error:`, no traceback.

Each case runs `python -m colibri` in a subprocess, as a user would. Flag errors are refused before
torch is imported (fast); the cases that need a model use a tiny container built by the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_HF = ROOT / "colibri" / "data" / "demo"


def colibri(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd or ROOT, env=env)


def assert_one_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The refusal contract; returns the error line."""
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("colibri: error:")]
    assert len(errors) == 1, r.stderr
    other = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("colibri: error:")
             and not ln.startswith("no --model given")]
    assert not other, f"more than the error line on stderr: {r.stderr!r}"
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


FLAG_MISTAKES = [
    (["--temperature", "nan", "-p", "x"], "--temperature"),
    (["--json-schema", "{bad", "-p", "x"], "--json-schema"),
    (["--json-schema", "{}", "--grammar", 'root ::= "a"', "-p", "x"], "not several"),
    (["--grammar-file", "/nonexistent/g.gbnf", "-p", "x"], "--grammar-file"),
    (["--temp", "inf", "-p", "x"], "--temperature"),
    (["--temperature", "-1", "-p", "x"], "--temperature"),
    (["--top-p", "nan", "-p", "x"], "--top-p"),
    (["--min-p", "2", "-p", "x"], "--min-p"),
    (["--top-p", "0", "-p", "x"], "--top-p"),
    (["--top-p", "1.5", "-p", "x"], "--top-p"),
    (["--repeat-penalty", "nan", "-p", "x"], "--repeat-penalty"),
    (["--repeat-penalty", "0", "-p", "x"], "--repeat-penalty"),
    (["--mem-budget", "nan", "-p", "x"], "--mem-budget"),
    (["--mem-budget", "inf", "-p", "x"], "--mem-budget"),
    (["--mem-budget", "1e400", "-p", "x"], "--mem-budget"),
    (["--mem-budget", "-3G", "-p", "x"], "--mem-budget"),
    (["--gpu-budget", "nan", "-p", "x"], "--gpu-budget"),
    (["--seed", str(2**70), "-p", "x"], "--seed"),
    (["--seed", "-1", "-p", "x"], "--seed"),
    (["--ctx-size", "1000000000000", "-p", "x"], "--ctx-size"),
    (["--ctx-size", "20000000", "-p", "x"], "--ctx-size"),
    (["--ctx-size", "0", "-p", "x"], "--ctx-size"),
    (["--threads", "0", "-p", "x"], "--threads"),
    (["-n", "-3", "-p", "x"], "-n"),
    (["--bogus-flag"], "--bogus-flag"),
    (["bench", "--model", "m.coli", "--threads", "-1"], "--threads"),
    (["bench", "--model", "m.coli", "--mem-budget", "nan"], "--mem-budget"),
    (["plan", "--model", "m.coli", "--ctx-size", "-5"], "--ctx-size"),
    (["serve", "--model", "m.coli", "--port", "0"], "--port"),
    (["serve", "--model", "m.coli", "--port", "70000"], "--port"),
    (["chat", "--model", "m.coli", "--temperature", "nan"], "--temperature"),
    (["convert", "-i", "x", "-o", "y", "--quant", "int9"], "int9"),
    (["convert", "-o", "y"], "--input"),
    (["inspect"], "file"),
    (["perplexity", "--model", "m.coli", "-f", "t.txt", "--ctx-size", "nan"], "--ctx-size"),
]


@pytest.mark.parametrize("args,needle", FLAG_MISTAKES, ids=[" ".join(a) for a, _ in FLAG_MISTAKES])
def test_flag_mistakes_are_one_line(args, needle, tmp_path):
    assert_one_error(colibri(*args, cwd=tmp_path), needle)


def test_version_and_ngl_spelling():
    r = colibri("--version")
    assert r.returncode == 0 and r.stdout.startswith("colibri ")
    # -ngl is --gpu-layers (llama.cpp's spelling), not `-n gl`: its value is checked as a layer count
    assert_one_error(colibri("-ngl", "x", "-p", "hi"), "--gpu-layers")
    from colibri.cli.run import run_parser

    assert run_parser().parse_args(["-ngl", "3", "-p", "x"]).gpu_layers == 3


def test_model_and_input_paths(tmp_path):
    assert_one_error(colibri("--model", str(DEMO_HF), "-p", "hi"), "Hugging Face folder", "colibri convert -i")
    assert_one_error(colibri("inspect", str(DEMO_HF)), "Hugging Face folder", "colibri convert -i")
    assert_one_error(colibri("plan", "--model", str(DEMO_HF)), "Hugging Face folder", "colibri convert -i")
    assert_one_error(colibri("--model", str(tmp_path), "-p", "hi"), "is a folder")
    assert_one_error(colibri("--model", str(tmp_path / "none.coli"), "-p", "hi"), "not found")
    assert_one_error(colibri("convert", "-i", str(DEMO_HF / "model.safetensors"), "-o", str(tmp_path / "o.coli")),
                     "not a file", f"-i {DEMO_HF}")
    assert_one_error(colibri("convert", "-i", str(tmp_path / "nope"), "-o", str(tmp_path / "o.coli")),
                     "does not exist")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from colibri.convert.converter import convert

    return convert(DEMO_HF, tmp_path_factory.mktemp("cli") / "demo.coli", "bf16", progress=False)


def test_mistakes_that_need_the_model(tiny, tmp_path):
    m = str(tiny)
    # usage file in a folder that does not exist: refused before generating, not after
    r = colibri("--model", m, "-p", "hi", "-n", "2", "--usage-file", str(tmp_path / "no" / "u.json"))
    assert_one_error(r, "--usage-file")
    assert r.stdout == ""
    assert_one_error(colibri("--model", m, "-p", "hi", "-n", "2", "--route-trace", str(tmp_path / "no" / "t.jsonl")),
                     "--route-trace")
    # a prompt that does not fit the context: one message, not a warning and then an error
    assert_one_error(colibri("--model", m, "-p", "a long prompt about many things", "--ctx-size", "3", "-n", "2"),
                     "does not fit ctx-size 3")
    assert_one_error(colibri("plan", "--model", m, "--ctx-size", "-5"), "--ctx-size")
    assert_one_error(colibri("plan", "--model", m, "--mem-budget", "1e400"), "1e400")


def test_warnings_are_one_line(tiny):
    r = colibri("--model", str(tiny), "-p", "hi", "-n", "2", "--temp", "0", "--no-stats", "--threads",
                str((os.cpu_count() or 1) + 1), "--gpu-budget", "1G")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert sum("--threads" in ln for ln in lines) == 1, r.stderr
    import torch

    if not torch.cuda.is_available():
        assert sum("--gpu-budget ignored" in ln for ln in lines) == 1, r.stderr


def test_broken_chat_template(tiny, tmp_path):
    """A container whose chat template does not compile: `--chat` is one line (plain runs still work)."""
    from colibri.convert.converter import convert
    from colibri.format.container import Container

    hf = tmp_path / "hf"
    hf.mkdir()
    for f in DEMO_HF.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for %}"
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = convert(hf, tmp_path / "t.coli", "bf16", progress=False)
    Container(out).close()
    assert_one_error(colibri("--model", str(out), "-p", "hi", "-n", "2", "--chat"), "chat template")


def test_bare_colibri_runs_the_demo(monkeypatch, capsys):
    """Bare `colibri` runs what scripts/demo.sh runs (checked in-process: the demo itself takes a while)."""
    import colibri.cli.run as run
    from colibri.cli import main
    from colibri.demo import DEMO_ARGS

    seen = []
    monkeypatch.setattr(run, "main", lambda argv: seen.append(argv) or 0)
    assert main([]) == 0
    assert seen == [list(DEMO_ARGS)] and "--model" not in DEMO_ARGS  # no --model: the built-in demo model
    assert "running the built-in demo model" in capsys.readouterr().err


def test_api_mistakes_are_colibri_errors(tiny):
    """The Python API's public methods refuse bad input with a ColibriError (the CLI's one line)."""
    import colibri
    from colibri.errors import ColibriError

    with colibri.load(tiny, ctx_size=32, threads=1) as llm:
        vocab = llm.vocab_rows
        for call in (lambda: llm.logits([1, vocab]), lambda: llm.logits([-1]), lambda: llm.logits([]),
                     lambda: list(llm.generate("hi", max_tokens=2.5)), lambda: list(llm.generate(5, max_tokens=2)),
                     lambda: list(llm.generate_ids([1], max_tokens="3")),
                     lambda: list(llm.generate("hi", max_tokens=2, temperature=float("nan"))),
                     lambda: llm.generate_batch("ab", max_tokens=2)):
            with pytest.raises(ColibriError):
                call()
        assert llm.logits([1, 2]).shape == (2, vocab)  # still serving after the refusals
