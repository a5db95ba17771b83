"""The command line: seed flags, stdout discipline, and one clear line for every bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import colibri
from colibri.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "colibri", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_run_streams_only_generated_text_to_stdout(ckpt, capsys):
    model = str(ckpt.coli("mixtral", "f32"))
    rc, out, err = run(["--model", model, "--prompt", "Hello", "-n", "12", "--temperature", "0",
                        "--ctx-size", "64", "--threads", "2"], capsys)
    assert rc == 0
    import colibri

    llm = colibri.load(model, ctx_size=64)
    expected = "".join(llm.generate("Hello", 12, temperature=0))
    assert out == expected + "\n"  # nothing but the text (and a final newline)
    assert "[colibri] prompt" in err and "decode" in err and "peak RSS" in err


def test_structured_output_flags(ckpt, capsys, tmp_path):
    pytest.importorskip("llguidance")
    model = str(ckpt.coli("mixtral", "f32"))
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["color", "n"], "additionalProperties": False}
    rc, out, _ = run(["-m", model, "-p", "Once upon", "-n", "64", "--temp", "0", "--ctx-size", "96",
                      "--json-schema", json.dumps(schema)], capsys)
    obj = json.loads(out)
    assert rc == 0 and obj["color"] in ("red", "blue") and 0 <= obj["n"] <= 9
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= ("yes" | "no") "!"')
    rc, out, _ = run(["-m", model, "-p", "Once upon", "-n", "16", "--temp", "1", "--seed", "3", "--ctx-size", "96",
                      "--grammar-file", str(g)], capsys)
    assert rc == 0 and out in ("yes!\n", "no!\n")


def test_run_subcommand_is_the_bare_form(ckpt, capsys):
    args = ["--model", str(ckpt.coli("mixtral", "f32")), "-p", "Hi", "-n", "8", "--temp", "0", "--no-stats"]
    assert run(["run", *args], capsys)[1] == run(args, capsys)[1]


def test_seeded_sampling_is_reproducible(ckpt, capsys):
    args = ["-m", str(ckpt.coli("olmoe", "f32")), "-p", "Once", "-n", "16", "--temperature", "1.5",
            "--no-stats", "--ignore-eos"]
    first, second = run([*args, "--seed", "7"], capsys)[1], run([*args, "--seed", "7"], capsys)[1]
    assert first == second
    assert run([*args, "--seed", "8"], capsys)[1] != first


def test_context_overflow_stops_with_a_message(ckpt, capsys):
    rc, out, err = run(["-m", str(ckpt.coli("mixtral", "f32")), "-p", "Hello there", "-n", "100",
                        "--ctx-size", "16", "--ignore-eos", "--temp", "0"], capsys)
    assert rc == 0
    assert "context is full" in err and "--ctx-size 16" in err
    prompt_too_long = run(["-m", str(ckpt.coli("mixtral", "f32")), "-p", "word " * 40, "--ctx-size", "8"], capsys)
    assert prompt_too_long[0] == 1 and "does not fit ctx-size 8" in prompt_too_long[2]


def test_debug_logs_experts_per_layer(ckpt, capsys):
    rc, out, err = run(["-m", str(ckpt.coli("mixtral", "f32")), "-p", "Hi", "-n", "3", "--temp", "0",
                        "--log-level", "debug", "--ignore-eos"], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("[req-") and " layer " in ln]
    n_layers = 3  # the tiny mixtral
    llm = colibri.load(ckpt.coli("mixtral", "f32"), ctx_size=16)
    n_prompt = len(llm.tokenizer.encode("Hi"))
    llm.close()
    assert rc == 0 and len(lines) == (n_prompt + 3) * n_layers  # every prompt and every generated token
    assert all(" pos " in ln and " tok " in ln and ":" in ln.split(": ", 1)[1] for ln in lines)


@pytest.mark.parametrize("argv, message", [
    (["-m", "/nonexistent.coli", "-p", "x"], "not found"),
    (["-m", "pyproject.toml", "-p", "x"], "not a colibri container"),
    (["-m", "pyproject.toml"], "no prompt"),
    (["-m", "x.coli", "-p", "x", "--top-p", "1.5"], "--top-p"),
    (["-m", "x.coli", "-p", "x", "--temperature", "-1"], "--temperature"),
    (["-m", "x.coli", "-f", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["inspect", "/nonexistent.coli"], "cannot open"),
    (["convert", "--input", "/nonexistent", "--output", "x.coli"], "does not exist"),
])
def test_bad_input_is_one_line_no_traceback(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, out, err = run(argv, capsys)
    assert rc == 1
    assert err.startswith("colibri: error:") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_bad_flag_values_exit_nonzero(capsys):
    for argv in (["-m", "x", "-p", "x", "--ctx-size", "0"], ["-m", "x", "-p", "x", "--threads", "two"],
                 ["-m", "x", "-p", "x", "--gpu-layers", "-1"]):
        assert main(argv) == 1  # colibri's one line (not argparse's usage block and exit 2)
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("colibri: error:") and err.count("\n") == 1


def test_tier_flags_are_validated(ckpt, capsys):
    model = str(ckpt.coli("mixtral", "f32"))  # 3 layers
    rc, _, err = run(["-m", model, "-p", "x", "--ram-layers", "2", "--disk-layers", "2"], capsys)
    assert rc == 1 and "only 3 layers" in err
    rc, _, err = run(["-m", model, "-p", "x", "--gpu-layers", "1", "--ram-layers", "1", "--disk-layers", "0"],
                     capsys)
    assert rc == 1 and "add up" in err


def test_unsupported_model_type_names_the_supported_ones(ckpt, tmp_path, capsys):
    src = ckpt.hf("mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama4_text_moe"
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(["convert", "-i", str(bad), "-o", str(tmp_path / "x.coli")], capsys)
    assert rc == 1 and "unsupported model_type 'llama4_text_moe'" in err and "mixtral" in err


def test_missing_tokenizer_is_refused(ckpt, tmp_path, capsys):
    bad = tmp_path / "notok"
    shutil.copytree(ckpt.hf("mixtral"), bad)
    (bad / "tokenizer.json").unlink()
    rc, _, err = run(["convert", "-i", str(bad), "-o", str(tmp_path / "x.coli")], capsys)
    assert rc == 1 and "no tokenizer.json" in err
    assert not (tmp_path / "x.coli").exists()


def test_arch_flag_is_checked(ckpt, tmp_path, capsys):
    rc, _, err = run(["convert", "-i", str(ckpt.hf("mixtral")), "-o", str(tmp_path / "x.coli"), "--arch",
                      "dense"], capsys)
    assert rc == 1 and "Mixture-of-Experts" in err and "--arch moe" in err


def test_inspect_detects_corruption(ckpt, tmp_path, capsys):
    path = tmp_path / "m.coli"
    shutil.copy(ckpt.coli("mixtral", "int8"), path)
    rc, out, err = run(["inspect", str(path)], capsys)
    assert rc == 0 and "mixtral" in out and "checksums OK" in err
    data = bytearray(path.read_bytes())
    data[4096 + 100] ^= 0xFF  # inside the first tensor's data
    path.write_bytes(bytes(data))
    rc, out, err = run(["inspect", str(path)], capsys)
    assert rc == 1 and "checksum mismatch" in err


def test_seed_convert_script_and_console_entry(ckpt, tmp_path):
    """`python tools/convert.py ...` (the converter called by path), then the CLI in a fresh process."""
    out = tmp_path / "m.coli"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "convert.py"), "--input", str(ckpt.hf("olmoe")),
                        "--output", str(out), "--arch", "moe", "--quant", "int8"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "checksums and shapes verified" in p.stderr
    r = cli("--model", str(out), "--prompt", "Hello", "-n", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "[colibri]" in r.stderr and "[colibri]" not in r.stdout
    r = cli("--model", str(tmp_path / "missing.coli"), "--prompt", "x")
    assert r.returncode == 1 and r.stderr.strip() == f"colibri: error: model file {tmp_path / 'missing.coli'} not found"


def test_help_lists_every_seed_flag():
    text = cli("--help").stdout
    for flag in ("--model", "--prompt", "--file", "--n-predict", "--ctx-size", "--threads", "--temperature",
                 "--top-k", "--top-p", "--repeat-penalty", "--seed", "--ignore-eos", "--log-level",
                 "--gpu-layers", "--ram-layers", "--disk-layers"):
        assert flag in text
