"""Tests for the .coli container: round trip, layout guarantees, atomicity, every refusal path."""

from __future__ import annotations

import gc
import json
import os
import struct
import zlib
from pathlib import Path

import psutil
import pytest
import torch

from colibri.errors import ColibriError, ContainerError
from colibri.format.container import Container, Writer
from colibri.format.layout import ALIGN, MAGIC, MEMBER_ALIGN, PREAMBLE_SIZE

META = {  # no model_type: a plain tensor file (a model container's meta is checked against its tensors)
    "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 4, "vocab_size": 100},
    "quant": {"scheme": "int4", "group_size": 32},
    "tokenizer": {"json": '{"model": {}}', "config": {"eos_token": "</s>"}},
}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(3, 5, generator=g),
        "a.bf16": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "a.f16": torch.randn(130, generator=g).to(torch.float16),
        "a.i8": torch.randint(-128, 128, (4, 33), generator=g, dtype=torch.int8),
        "a.u8": torch.randint(0, 256, (65,), generator=g, dtype=torch.uint8),
        "a.i32": torch.tensor([1, -2, 2**31 - 1], dtype=torch.int32),
        "a.scalar": torch.tensor(3.5),
        "a.empty": torch.zeros(0, 4),
        "a.noncontig": torch.arange(12, dtype=torch.float32).view(3, 4).t(),
    }


def _members() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "gate_up.weight": (
            torch.randint(0, 256, (8, 3), generator=g, dtype=torch.uint8),
            {"quant": {"s": 1}},
        ),
        "gate_up.weight.scale": torch.randn(8, 1, generator=g).to(torch.float16),
        "down.weight": torch.randint(0, 256, (4, 5), generator=g, dtype=torch.uint8),
        "down.bias": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def _write(path: Path) -> None:
    with Writer(path, META) as w:
        for name, t in _tensors().items():
            w.add_tensor(name, t, role="test")
        w.add_record("model.layers.0.mlp.experts.0", _members())
        w.add_record("model.layers.0.mlp.experts.1", _members())
        w.add_tensor("z.last", torch.ones(2))


@pytest.fixture
def coli(tmp_path: Path) -> Path:
    p = tmp_path / "m.coli"
    _write(p)
    return p


def _err(path: Path, **kw) -> str:
    """Open `path`, expect a ContainerError; return its message, checked to be one line."""
    with pytest.raises(ContainerError) as ei:
        Container(path, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def _craft(path: Path, header: dict, data_size: int, version: int = 1) -> None:
    """Hand-build a container: preamble + sparse (hole) data region + header."""
    blob = json.dumps(header).encode()
    h_off = PREAMBLE_SIZE + data_size
    with open(path, "wb") as f:
        size = h_off + len(blob)
        f.write(struct.pack("<8sIIQQIQ", MAGIC, version, 0, h_off, len(blob), zlib.crc32(blob), size))
        f.seek(h_off)  # seeking past EOF leaves a hole: a 1 GiB data region costs no disk or time
        f.write(blob)


def test_round_trip(coli: Path) -> None:
    with Container(coli, verify=True) as c:
        assert c.meta == META and c.model_type is None
        assert c.config["hidden_size"] == 64 and c.quant == {"scheme": "int4", "group_size": 32}
        for name, t in _tensors().items():
            got = c.tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
            assert c.info(name)["role"] == "test" and c.has(name) and name in c
        rec = c.record("model.layers.0.mlp.experts.1")
        for sub, spec in _members().items():
            t = spec[0] if isinstance(spec, tuple) else spec
            full = f"model.layers.0.mlp.experts.1.{sub}"
            assert rec["tensors"][sub] == full and rec["members"][sub]["name"] == full
            assert torch.equal(c.tensor(full), t)
        assert c.info("model.layers.0.mlp.experts.0.gate_up.weight")["quant"] == {"s": 1}
        assert c.info("model.layers.0.mlp.experts.0.down.weight")["record"] == "model.layers.0.mlp.experts.0"
        assert c.record_names() == ["model.layers.0.mlp.experts.0", "model.layers.0.mlp.experts.1"]
        assert not c.has("nope") and c.has_record("model.layers.0.mlp.experts.0")
        assert torch.equal(c.tensor("z.last"), torch.ones(2))
        assert c.file_size == os.path.getsize(coli)
        s = c.summary()
        assert "model_type:  ?" in s and "records:     2" in s and "int4" in s and "bf16" in s
        with pytest.raises(ContainerError, match="no tensor named"):
            c.tensor("nope")
        with pytest.raises(ContainerError, match="no record named"):
            c.record("nope")


def test_alignment_and_record_contiguity(coli: Path) -> None:
    with Container(coli) as c:
        for name in c.names():
            e = c.info(name)
            assert e["offset"] % (MEMBER_ALIGN if "record" in e else ALIGN) == 0, name
        for rname in c.record_names():
            r = c.record(rname)
            assert r["offset"] % ALIGN == 0
            ms = sorted(r["members"].values(), key=lambda m: m["offset"])
            assert [m["name"] for m in ms] == list(r["tensors"].values())  # write order
            assert ms[0]["offset"] == r["offset"] and ms[0]["rel_offset"] == 0
            for prev, nxt in zip(ms, ms[1:]):
                # packed: the next member starts at the first 64-byte boundary after the previous
                end = prev["offset"] + prev["nbytes"]
                assert nxt["offset"] == (end + MEMBER_ALIGN - 1) // MEMBER_ALIGN * MEMBER_ALIGN
            assert r["offset"] + r["nbytes"] == ms[-1]["offset"] + ms[-1]["nbytes"]


def test_zero_copy_views_and_record_views(coli: Path) -> None:
    c = Container(coli)
    base = torch.frombuffer(c._mm, dtype=torch.uint8, count=1).data_ptr()  # start of the mapping
    for name in ("a.f32", "a.bf16", "model.layers.0.mlp.experts.0.down.weight"):
        t = c.tensor(name)
        assert t.data_ptr() - base == c.info(name)["offset"]
        assert t.is_contiguous()
    name = "model.layers.0.mlp.experts.1"
    r = c.record(name)
    buf = torch.full((r["nbytes"] + 100,), 7, dtype=torch.uint8)  # reusable, oversized
    buf[: r["nbytes"]] = torch.frombuffer(bytearray(coli.read_bytes()[r["offset"] : r["offset"] + r["nbytes"]]),
                                          dtype=torch.uint8)  # the record's bytes, as the store's reader fills them
    views = c.record_views(name, buf)
    for sub, v in views.items():
        assert v.data_ptr() - buf.data_ptr() == c.record(name)["members"][sub]["rel_offset"]
        assert torch.equal(v, c.tensor(f"{name}.{sub}"))
    kept = c.tensor("a.f32")
    c.close()
    del c
    gc.collect()
    # the mapping outlives the container while views reference it
    assert torch.equal(kept, _tensors()["a.f32"])


def test_atomic_write_on_exception(tmp_path: Path) -> None:
    p = tmp_path / "x.coli"
    with pytest.raises(RuntimeError), Writer(p, META) as w:
        w.add_tensor("a", torch.ones(1000))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    _write(p)
    before = p.read_bytes()
    with pytest.raises(ContainerError), Writer(p, {"bad": float("nan")}) as w:  # strict JSON only
        w.add_tensor("a", torch.ones(3))
    assert p.read_bytes() == before and sorted(tmp_path.iterdir()) == [p]


def test_writer_refusals(tmp_path: Path) -> None:
    p = tmp_path / "w.coli"
    with Writer(p, {}) as w:
        w.add_tensor("a", torch.ones(2))
        with pytest.raises(ContainerError, match="duplicate tensor name"):
            w.add_tensor("a", torch.ones(2))
        with pytest.raises(ContainerError, match="unsupported dtype"):
            w.add_tensor("f64", torch.ones(2, dtype=torch.float64))
        with pytest.raises(ContainerError, match="reserved"):
            w.add_tensor("b", torch.ones(2), offset=3)
        with pytest.raises(ContainerError, match="not strict JSON"):
            w.add_tensor("b", torch.ones(2), scale=float("inf"))
        # a refused member aborts the whole record before any byte of it is written
        with pytest.raises(ContainerError, match="unsupported dtype"):
            w.add_record("r", {"x": torch.ones(2), "y": torch.ones(2, dtype=torch.float64)})
        w.add_record("r", {"x": torch.ones(2)})
        with pytest.raises(ContainerError, match="duplicate record name"):
            w.add_record("r", {"z": torch.ones(2)})
    with Container(p, verify=True) as c:
        assert c.names() == ["a", "r.x"]
    with pytest.raises(ContainerError, match="cannot create"):
        Writer(tmp_path / "no" / "dir.coli", {})


def test_bad_magic_empty_missing(tmp_path: Path) -> None:
    p = tmp_path / "f.coli"
    p.write_bytes(b"GGUF" + bytes(5000))
    assert "not a colibri container (bad magic)" in _err(p)
    p.write_bytes(b"")
    assert "empty" in _err(p)
    assert _err(tmp_path / "missing.coli").startswith("cannot open")
    assert "not a regular file" in _err(tmp_path)
    p.write_bytes(MAGIC + bytes(10))
    assert "truncated" in _err(p)


def test_future_version(coli: Path) -> None:
    raw = bytearray(coli.read_bytes())
    struct.pack_into("<I", raw, 8, 2)
    coli.write_bytes(raw)
    assert "format version 2 is newer than this colibri supports (1)" in _err(coli)


def test_truncated(coli: Path) -> None:
    size = coli.stat().st_size
    os.truncate(coli, size - 10)
    assert f"truncated: expected {size} bytes, found {size - 10}" in _err(coli)


def test_header_damage(coli: Path) -> None:
    raw = bytearray(coli.read_bytes())
    raw[-5] ^= 0xFF
    coli.write_bytes(raw)
    assert "header checksum mismatch" in _err(coli)


def test_out_of_range_and_inconsistent_entries(tmp_path: Path) -> None:
    p = tmp_path / "h.coli"

    def header(**t: dict) -> dict:
        return {"format": "colibri", "version": 1, "meta": {}, "tensors": t, "records": {}}

    ok = {"dtype": "f32", "shape": [2], "offset": PREAMBLE_SIZE, "nbytes": 8, "crc32": 0}
    _craft(p, header(w=ok), 4096)
    with Container(p) as c:
        assert c.tensor("w").shape == (2,)
    _craft(p, header(w={**ok, "offset": 8192}), 4096)  # data region is [4096, 8192)
    assert "tensor w: data [8192, 8200) outside the data region" in _err(p)
    _craft(p, header(w={**ok, "shape": [3]}), 4096)
    assert "do not match" in _err(p)
    _craft(p, header(w={**ok, "dtype": "f64"}), 4096)
    assert "unknown dtype" in _err(p)
    rec = {"offset": PREAMBLE_SIZE, "nbytes": 4, "tensors": {"x": "w"}}
    _craft(p, {**header(w=ok), "records": {"r": rec}}, 4096)
    assert "member w lies outside the record" in _err(p)
    _craft(p, header(w=ok), 4096, version=2)
    assert "newer" in _err(p)


def test_checksum_mismatch(coli: Path) -> None:
    with Container(coli) as c:
        off = c.info("a.bf16")["offset"]
    raw = bytearray(coli.read_bytes())
    raw[off + 3] ^= 0x01
    coli.write_bytes(raw)
    with Container(coli) as c:  # opening does not read data, so it still succeeds
        with pytest.raises(ContainerError) as ei:
            c.verify()
        assert "checksum mismatch in tensor a.bf16" in str(ei.value) and "\n" not in str(ei.value)
    assert "checksum mismatch in tensor a.bf16" in _err(coli, verify=True)


def test_verify_progress(coli: Path) -> None:
    seen: list[tuple[int, int]] = []
    with Container(coli) as c:
        c.verify(lambda done, total: seen.append((done, total)))
        total = sum(c.info(n)["nbytes"] for n in c.names())
    assert seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_open_reads_only_header(tmp_path: Path) -> None:
    p = tmp_path / "big.coli"
    size = 1 << 30
    entry = {"dtype": "bf16", "shape": [size // 2], "offset": PREAMBLE_SIZE, "nbytes": size, "crc32": 0}
    _craft(p, {"format": "colibri", "version": 1, "meta": {}, "tensors": {"w": entry}, "records": {}}, size)
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    with Container(p) as c:
        t = c.tensor("w")  # a 1 GiB view: still nothing read
        assert t.numel() == size // 2
        assert proc.memory_info().rss - rss0 < 16 << 20
        del t


def test_error_is_one_line() -> None:
    e = ContainerError("cannot open x:\n  line two\n")
    assert str(e) == "cannot open x: line two" and isinstance(e, ColibriError)
