"""Run-time integrity: CRC-32C per tensor and record, checked on every read into engine memory.

The stored values are checked against the `crc32c` package called directly on the file's bytes;
damaged bytes must stop the run with one error naming the tensor, never change its output.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import crc32c
import pytest
import torch
from fuzz_mutants import dump, split, with_header

from colibri.api import Engine
from colibri.arena import aligned_buffer
from colibri.cli import main as cli_main
from colibri.errors import ContainerError
from colibri.format import integrity
from colibri.format.container import Container, Writer
from colibri.store import Placement
from colibri.store.reader import RecordReader

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def _damaged_copy(src: Path, dst: Path, member: str = "down.weight", every: bool = True) -> list[str]:
    """Copy `src` and flip one byte of `member` in every expert record (or only the first)."""
    shutil.copy(src, dst)
    names = []
    with Container(src) as c:
        for rec in c.record_names():
            full = c.record(rec)["tensors"][member]
            _flip(dst, c.info(full)["offset"] + 5)
            names.append(full)
            if not every:
                break
    return names


def _greedy(path: Path, **kw) -> list[int]:
    llm = Engine(path, ctx_size=64, threads=1, **kw)
    try:
        return list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True))
    finally:
        llm.close()


def _disk_kw(path: Path) -> dict:
    with Container(path) as c:
        n = c.config["num_hidden_layers"]
    return {"placement": Placement(["disk"] * n), "mem_budget": 1 << 30}


def test_writer_stores_crc32c_of_every_tensor_and_record(ckpt):
    path = ckpt.coli("olmoe", "int8")
    data = path.read_bytes()
    with Container(path) as c:
        h = c.header
    assert h["records"] and h["tensors"]
    for e in h["tensors"].values():
        assert "crc32" not in e
        assert e["crc32c"] == crc32c.crc32c(data[e["offset"] : e["offset"] + e["nbytes"]])
    for r in h["records"].values():
        assert r["crc32c"] == crc32c.crc32c(data[r["offset"] : r["offset"] + r["nbytes"]])


def test_clean_file_reads_verified_and_identical(ckpt):
    """Every record read is checked (the verified byte count covers each read), and the output is the
    mapped (unchecked) path's, bit for bit."""
    path = ckpt.coli("olmoe", "int8")
    llm = Engine(path, ctx_size=64, threads=1, **_disk_kw(path))
    try:
        got = list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True))
        s = llm.store_stats()
        checks = llm.store.reader.checks
        assert s["misses"] > 0 and checks.verified >= s["bytes_read"] > 0
    finally:
        llm.close()
    assert got == _greedy(path)


@pytest.mark.parametrize("placement", [["ram"] * 3, ["ram", "disk", "disk"]])
def test_mapped_weights_are_checked_once_at_load(ckpt, tmp_path, placement):
    """With `mmap` (and no budget), dense weights and RAM-layer experts are views of the mapping: checked
    once when the engine loads, before any is used; disk-layer experts are checked on each read instead."""
    path = ckpt.coli("olmoe", "int8")
    llm = Engine(path, ctx_size=64, threads=1, placement=Placement(placement), mmap=True)
    checks = llm.store.reader.checks
    with Container(path) as c:
        h = c.header
    ram_records = sum(r["nbytes"] for n, r in h["records"].items() if placement[int(n.split(".")[2])] == "ram")
    dense = sum(e["nbytes"] for e in h["tensors"].values() if "record" not in e)
    assert checks.verified == dense + ram_records
    llm.close()
    bad = tmp_path / "bad.coli"
    _damaged_copy(path, bad, every=False)  # layer 0's expert 0: a RAM layer in both placements
    with pytest.raises(ContainerError, match=r"tensor model\.layers\.0\.mlp\.experts\.0\.down\.weight"):
        Engine(bad, ctx_size=64, threads=1, placement=Placement(placement), mmap=True)


def test_flipped_expert_byte_stops_the_run_naming_the_tensor(ckpt, tmp_path, capsys):
    path = ckpt.coli("olmoe", "int8")
    bad = tmp_path / "bad.coli"
    names = _damaged_copy(path, bad)
    with pytest.raises(ContainerError, match=r"checksum mismatch in tensor model\.layers\.\d+\.mlp\.experts\.\d+"
                                             r"\.down\.weight \(record "):
        _greedy(bad, **_disk_kw(bad))
    rc = cli_main(["--model", str(bad), "-p", "hello world", "-n", "4", "--temp", "0", "--ignore-eos",
                   "--disk-layers", "3", "--mem-budget", "1G"])
    out = capsys.readouterr()
    assert rc != 0 and out.out.strip() == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: ") and "Traceback" not in out.err
    assert any(n in lines[0] for n in names)


def test_flipped_dense_byte_under_a_budget_mapped_and_with_verify(ckpt, tmp_path, capsys):
    """A budget (and the default) reads dense weights into engine memory: checked there. With `mmap` they
    are mapped and checked once at load; `--verify` checks the whole file first (docs/FORMAT.md, "Checksums")."""
    path = ckpt.coli("olmoe", "int8")
    bad = tmp_path / "bad.coli"
    shutil.copy(path, bad)
    with Container(path) as c:
        _flip(bad, c.info("model.norm.weight")["offset"] + 1)
    for kw in (_disk_kw(bad), {}, {"mmap": True}):
        with pytest.raises(ContainerError, match=r"checksum mismatch in tensor model\.norm\.weight"):
            _greedy(bad, **kw)
    rc = cli_main(["--model", str(bad), "-p", "hello", "-n", "2", "--verify"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "model.norm.weight" in err[0]


def _padded_container(path: Path) -> None:
    with Writer(path) as w:
        # members of 3 and 40 bytes: 61 bytes of padding between them (64-aligned members)
        w.add_record("r", {"a": torch.arange(3, dtype=torch.uint8), "b": torch.arange(10, dtype=torch.float32)})
        w.add_tensor("big", torch.arange(40_000, dtype=torch.int32))  # 160,000 bytes: read in chunks


def test_checks_name_the_member_or_the_record_padding(tmp_path):
    p = tmp_path / "r.coli"
    _padded_container(p)
    with Container(p) as c:
        rec, b_off = c.header["records"]["r"], c.info("r.b")["offset"]
    data = bytearray(p.read_bytes())
    checks = integrity.Checks(str(p), Container(p).header)
    checks.after_read(bytes(data[rec["offset"] :]), rec["offset"], rec["nbytes"])  # clean: silent
    assert checks.verified == rec["nbytes"]
    for where, expect in ((b_off + 2, r"tensor r\.b \(record r\)"), (rec["offset"] + 10, r"in record r ")):
        bad = bytearray(data)
        bad[where] ^= 1
        with pytest.raises(ContainerError, match=expect):
            checks.after_read(bytes(bad[rec["offset"] :]), rec["offset"], rec["nbytes"])


@pytest.mark.parametrize("direct", [True, False])
def test_reader_checks_chunked_and_pieced_reads(tmp_path, direct):
    """read_ranges splits a tensor into chunks read in parallel (checked once complete); the GPU
    staging path reads one in consecutive pieces on one thread (checked at the last piece)."""
    p = tmp_path / "r.coli"
    _padded_container(p)
    with Container(p) as c:
        e, header = c.info("big"), c.header
    _flip(p, e["offset"] + 150_001)
    r = RecordReader(p, threads=2, direct=direct, checks=integrity.Checks(str(p), header))
    buf = aligned_buffer(e["nbytes"] + 4096)
    with pytest.raises(ContainerError, match="tensor big"):
        r.read_ranges([(buf, e["offset"], e["nbytes"])], chunk=8192)
    with pytest.raises(ContainerError, match="tensor big"):
        for pos in range(0, e["nbytes"], 65536):
            r.read_into(buf[:65536], e["offset"] + pos, min(65536, e["nbytes"] - pos))
    _flip(p, e["offset"] + 150_001)  # repaired: the same reads pass
    r.read_ranges([(buf, e["offset"], e["nbytes"])], chunk=8192)
    for pos in range(0, e["nbytes"], 65536):
        r.read_into(buf[:65536], e["offset"] + pos, min(65536, e["nbytes"] - pos))
    assert r.checks.verified == 2 * e["nbytes"]
    r.close()


def test_old_crc32_files_are_read_and_checked_with_zlib(ckpt, tmp_path, monkeypatch):
    """Files written before CRC-32C carry a zlib CRC-32 per tensor and none per record: they still
    load, verify and run; a flip names the member (checked member by member)."""
    from colibri.convert.converter import convert

    monkeypatch.setattr(integrity, "BACKEND", None)  # a Writer without a CRC-32C module writes "crc32"
    old = convert(ckpt.hf("olmoe"), tmp_path / "old.coli", "int8", progress=False)
    monkeypatch.undo()
    # ... per record too: drop those, as files of the old writer have none
    blob = old.read_bytes()
    _, h = split(blob)
    for r in h["records"].values():
        del r["crc32"]
    old.write_bytes(with_header(blob, dump(h)))
    data = old.read_bytes()
    with Container(old, verify=True) as c:
        h = c.header
    assert all("crc32c" not in r for r in h["records"].values())
    for e in h["tensors"].values():
        assert "crc32c" not in e and e["crc32"] == zlib.crc32(data[e["offset"] : e["offset"] + e["nbytes"]])
    new = ckpt.coli("olmoe", "int8")
    assert _greedy(old, **_disk_kw(old)) == _greedy(new, **_disk_kw(new))
    bad = tmp_path / "bad.coli"
    _damaged_copy(old, bad, "gate_up.weight")
    for kw in (_disk_kw(bad), {}, {"mmap": True}):  # read from disk, read whole, and mapped (checked at open)
        with pytest.raises(ContainerError, match=r"mismatch in tensor model\.layers\.\d+\.mlp\.experts\.\d+"
                                                 r"\.gate_up\.weight \(stored crc32 "):
            _greedy(bad, **kw)


def test_without_a_crc32c_module_the_error_says_what_to_install(tmp_path, monkeypatch):
    p = tmp_path / "r.coli"
    _padded_container(p)
    with Container(p) as c:
        rec, header = c.header["records"]["r"], c.header
    monkeypatch.setattr(integrity, "_crc32c", None)
    checks = integrity.Checks(str(p), header)
    with pytest.raises(ContainerError, match="no CRC-32C module is installed: pip install crc32c"):
        checks.verify(p.read_bytes()[rec["offset"] :], rec["offset"], rec["nbytes"])
