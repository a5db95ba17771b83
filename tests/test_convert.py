"""Converter: storage policy, atomicity, lazy reading (RSS), per-expert == fused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.format.container import Container


def test_storage_policy_keeps_sensitive_tensors_precise(ckpt):
    with Container(ckpt.coli("qwen2_moe", "int4")) as c:
        assert c.info("model.layers.0.input_layernorm.weight")["dtype"] == "f32"
        assert c.info("model.layers.0.mlp.gate.weight")["dtype"] == "f32"  # router
        assert c.info("model.layers.0.self_attn.q_proj.bias")["dtype"] == "f32"
        assert c.info("model.embed_tokens.weight")["dtype"] == "bf16"
        assert c.info("lm_head.weight")["quant"]["scheme"] == "int8"
        assert c.info("model.layers.0.self_attn.q_proj.weight")["quant"]["scheme"] == "int4"
        rec = c.record("model.layers.0.mlp.experts.0")
        assert set(rec["tensors"]) == {"gate_up.weight", "gate_up.weight.scale", "gate_up.weight.min",
                                       "down.weight", "down.weight.scale", "down.weight.min"}
        assert rec["offset"] % 4096 == 0


def test_per_expert_and_fused_checkpoints_convert_to_the_same_tensors(ckpt):
    with Container(ckpt.coli("qwen3_moe", "bf16")) as a, Container(ckpt.coli("qwen3_moe", "bf16", fused=True)) as b:
        assert sorted(a.names()) == sorted(b.names())
        for name in a.names():
            assert torch.equal(a.tensor(name), b.tensor(name)), name


def test_interrupted_conversion_leaves_no_file(ckpt, tmp_path, monkeypatch):
    from colibri.convert import safetensors_reader

    calls = {"n": 0}
    real = safetensors_reader.SafetensorsFolder.read

    def flaky(self, name, index=None):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt  # the user pressing Ctrl-C halfway
        return real(self, name, index)

    monkeypatch.setattr(safetensors_reader.SafetensorsFolder, "read", flaky)
    out = tmp_path / "m.coli"
    out.write_bytes(b"old contents")  # an existing file must survive untouched
    with pytest.raises(KeyboardInterrupt):
        convert(ckpt.hf("mixtral"), out, "int8", progress=False)
    assert out.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["m.coli"]  # no temp file left behind


def test_shape_mismatch_is_refused(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt.hf("mixtral"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] *= 2  # config no longer matches the tensors
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ColibriError, match="config implies"):
        convert(bad, tmp_path / "x.coli", "bf16", progress=False)
    assert not (tmp_path / "x.coli").exists()


def test_conversion_reads_lazily(ckpt, tmp_path):
    """Converting a ~300 MB checkpoint must not hold it in memory: peak RSS grows by a few tensors."""
    src = ckpt.hf("mixtral", hidden_size=512, intermediate_size=2048, num_local_experts=8, num_hidden_layers=3)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert size > 150 * 2**20
    script = textwrap.dedent(f"""
        import torch
        from colibri.convert.converter import convert
        def status(key):  # KiB; VmHWM is this process's own peak (ru_maxrss survives exec from pytest)
            return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key))
        torch.zeros(1)
        base = status("VmRSS:")
        convert({str(src)!r}, {str(tmp_path / 'big.coli')!r}, "int8", progress=False)
        print((status("VmHWM:") - base) * 1024)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    grown = int(p.stdout.split()[-1])
    largest = 2 * 2048 * 512 * 4  # one expert's gate+up in f32
    print(f"checkpoint {size / 2**20:.0f} MiB, peak RSS growth {grown / 2**20:.0f} MiB")
    # Measured 61-100 MiB on 299 MiB (allocator arenas of the reader threads vary run to run, before
    # and after the validation pass): half the checkpoint still fails any converter that holds it.
    assert grown < size / 2 and grown < 16 * largest
