"""Streamed decode at the physical limit: the figures `colibri bench` reports about it (bytes per token,
the reader's bandwidth, the in-RAM step, the limit and the share reached), and greedy output that stays
the same however slowly the reader delivers."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import torch
from test_tiers import PROMPT, configs

from colibri.analysis.probe import measure_disk
from colibri.api import Engine
from colibri.arena import aligned_buffer
from colibri.cli import main
from colibri.format.container import Container
from colibri.store import model_sizes
from colibri.store import reader as reader_mod
from colibri.store.limit import decode_limit, limit_text
from colibri.store.reader import IO_THREADS, RecordReader

# ----------------------------------------------------------------------------- the figures


def _check_limit(r: dict, tokens: int, decode_s: float) -> None:
    """The limit figures agree with each other and with the decode they describe."""
    step, disk, limit = r["in_ram_step_s"], r["disk_s_per_token"], r["limit_tok_s"]
    assert step >= 0 and disk >= 0 and limit > 0
    assert step + r["io_wait_s_per_token"] == pytest.approx(decode_s / tokens, rel=1e-9)
    assert limit == pytest.approx(1 / max(disk, step), rel=1e-9)
    assert r["limit_share"] == pytest.approx(tokens / decode_s / limit, rel=1e-9)
    assert 0 < r["limit_share"] <= 1 + 1e-9  # either term is at most the decode's own time per token


def test_decode_limit_from_counters():
    s = {"decode_bytes_per_token": 2e6, "decode_read_bps": 1e9, "decode_io_wait_s": 0.5}
    r = decode_limit(s, 2.0, 100)  # 2 ms of reads a token, 15 ms of compute: compute-bound
    assert r["read_bandwidth_bps"] == 1e9 and r["disk_s_per_token"] == pytest.approx(2e-3)
    assert r["in_ram_step_s"] == pytest.approx(0.015) and r["limit_bound"] == "compute"
    assert r["limit_tok_s"] == pytest.approx(1 / 0.015) and r["limit_share"] == pytest.approx(0.75)
    _check_limit(r, 100, 2.0)
    r = decode_limit({**s, "decode_bytes_per_token": 3e7}, 2.0, 100)  # 30 ms of reads a token: disk-bound
    assert r["limit_bound"] == "disk" and r["limit_tok_s"] == pytest.approx(1 / 0.03)
    assert "disk-bound" in limit_text(r) and "30.00 MB/token at 1.00 GB/s" in limit_text(r)
    # Nothing read while decoding: the limit is the in-RAM step (no division by a zero bandwidth).
    r = decode_limit({"decode_bytes_per_token": 0.0, "decode_read_bps": 0.0, "decode_io_wait_s": 0.0}, 1.0, 50)
    assert r["limit_bound"] == "ram" and r["read_bandwidth_bps"] is None and r["disk_s_per_token"] == 0
    assert r["limit_tok_s"] == pytest.approx(50) and r["limit_share"] == pytest.approx(1)
    assert "no disk reads" in limit_text(r) and "all in RAM" in limit_text(r)
    r = decode_limit(s, 0.0, 0)  # no decode step: nothing to say
    assert r["limit_tok_s"] is None and r["limit_share"] is None and "n/a" in limit_text(r)


def test_reader_busy_time_is_the_union_of_its_reads(ckpt, monkeypatch):
    """busy_s counts wall time with a read in flight, overlapping reads once: between one read's time
    (all overlapped) and the reads' summed time (none overlapped), never more than the wall time."""
    path = ckpt.coli("olmoe", "int8")
    real, nap = reader_mod._pread_full, 0.02

    def slow(*args):
        time.sleep(nap)
        return real(*args)

    monkeypatch.setattr(reader_mod, "_pread_full", slow)
    r = RecordReader(path, direct=False)
    assert r.threads == IO_THREADS and r.busy_s() == 0
    with Container(path) as c:
        rec = c.record(c.record_names()[0])
    bufs = [aligned_buffer(rec["nbytes"]) for _ in range(2 * IO_THREADS)]
    t0 = time.perf_counter()
    r.read_ranges([(b, rec["offset"], rec["nbytes"]) for b in bufs])
    wall = time.perf_counter() - t0
    assert 2 * nap <= r.busy_s() <= wall and r.reads == len(bufs)  # at least two rounds of IO_THREADS reads
    before = r.busy_s()
    r.read_into(bufs[0], rec["offset"], rec["nbytes"])
    assert r.busy_s() - before >= nap
    r.close()


def test_disk_probe_reads_at_the_readers_queue_depth(ckpt, monkeypatch):
    path = str(ckpt.coli("olmoe", "int8"))
    pools: list[int] = []

    class Pool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, workers: int):
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", Pool)
    bps, note = measure_disk(path, seconds=0.05, chunk=64 * 1024)
    assert bps > 0 and f"{IO_THREADS} at a time, as many as the store's reader threads" in note
    assert pools == [IO_THREADS]


@pytest.fixture(scope="module")
def model(ckpt):
    return ckpt.coli("olmoe", "int8")


def _bench(model, capsys, *extra: str) -> dict:
    assert main(["bench", "--model", str(model), "-n", "6", "--prompts", "2", "--json", "--threads", "2",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_reports_the_streamed_limit(model, capsys):
    with Container(model) as c:
        s = model_sizes(c)
    budget = s.dense_bytes + 4 * max(s.expert_bytes)  # 4 experts of 3 x 8: reads every token
    r = _bench(model, capsys, "--mem-budget", str(budget))
    st, tokens = r["store_stats"], r["generated"] - r["prompts"]
    assert st["decode_tokens"] == tokens and r["decode_bytes_read_per_token"] > 0
    # The bandwidth: bytes the reader read over the time it had a read in flight, both during decode steps.
    assert st["decode_reader_bytes"] > 0 and st["decode_reader_busy_s"] > 0
    assert r["read_bandwidth_bps"] == pytest.approx(st["decode_reader_bytes"] / st["decode_reader_busy_s"])
    assert r["decode_io_wait_s"] == st["decode_io_wait_s"] <= st["io_wait_s"]
    assert r["disk_s_per_token"] == pytest.approx(r["decode_bytes_read_per_token"] / r["read_bandwidth_bps"])
    assert r["limit_bound"] in ("disk", "compute")
    _check_limit(r, tokens, tokens / r["decode_tok_s"])
    assert r["disk_probe_bps"] > 0 and "as many as the store's reader threads" in r["disk_probe_note"]

    free = _bench(model, capsys)  # all in RAM: no reads, the limit is the in-RAM step
    assert free["outputs"] == r["outputs"]
    assert free["decode_bytes_read_per_token"] == 0 and free["read_bandwidth_bps"] is None
    assert free["limit_bound"] == "ram" and free["disk_s_per_token"] == 0
    assert free["limit_tok_s"] == pytest.approx(1 / free["in_ram_step_s"])
    _check_limit(free, tokens, tokens / free["decode_tok_s"])


def test_a_runs_own_stats_give_its_limit(model):
    """What `--stats` reads: one generate call's store stats (last_stats.extra["store"]) carry the decode
    counters of that call alone, so the limit comes out of them and the call's decode time."""
    with Container(model) as c:
        s = model_sizes(c)
    llm = Engine(model, ctx_size=128, threads=2, mem_budget=s.dense_bytes + 4 * max(s.expert_bytes))
    try:
        list(llm.generate_ids(PROMPT, 4, temperature=0, ignore_eos=True))  # (counters before the run)
        list(llm.generate_ids(PROMPT, 10, temperature=0, ignore_eos=True))
        st, total = llm.last_stats, llm.store_stats()
    finally:
        llm.close()
    run = st.extra["store"]
    assert run["decode_tokens"] == st.generated - 1 == 9 and total["decode_tokens"] == 3 + 9
    assert 0 < run["decode_reader_bytes"] < total["decode_reader_bytes"]
    assert 0 < run["decode_reader_busy_s"] < total["decode_reader_busy_s"]
    r = decode_limit(run, st.decode_s, st.generated - 1)
    assert r["read_bandwidth_bps"] == pytest.approx(run["decode_reader_bytes"] / run["decode_reader_busy_s"])
    _check_limit(r, 9, st.decode_s)
    assert "reached" in limit_text(r)


def test_bench_text_prints_the_limit_line(model, capsys):
    assert main(["bench", "--model", str(model), "-n", "3", "--prompts", "1", "--disk-layers", "2",
                 "--mem-budget", "10M", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("limit "))
    assert "tok/s" in line and "reached" in line and "in-RAM step" in line
    assert "disk probe" in out and "the store's reader threads" in out


# ----------------------------------------------------------------------------- a slow reader


def _greedy(path, n: int = 24, **kw) -> tuple[list[int], torch.Tensor, dict]:
    llm = Engine(path, ctx_size=128, threads=2, **kw)
    try:
        tokens = list(llm.generate_ids(PROMPT, n, temperature=0, ignore_eos=True))
        logits = llm.logits(PROMPT * 2)
        return tokens, logits, llm.store_stats()
    finally:
        llm.close()


@pytest.mark.parametrize("scheme", ["f32", "int8"])
def test_slow_reader_changes_no_token(ckpt, monkeypatch, scheme):
    """Every expert read made to take milliseconds more (reads land after the step that wanted them,
    prefetches after the layer they were for, the native call stops at more layers): the greedy tokens
    and logits are those of the same store reading at full speed, and those of the model all in RAM."""
    path = ckpt.coli("olmoe", scheme)
    kw = configs(path)["disk-1-per-layer"]
    ram_tokens, ram_logits, ram = _greedy(path)
    assert ram["cache_slots"] == 0
    fast_tokens, fast_logits, fast = _greedy(path, **kw)
    real = reader_mod._pread_full

    def slow(*args):
        time.sleep(0.003)
        return real(*args)

    monkeypatch.setattr(reader_mod, "_pread_full", slow)
    slow_tokens, slow_logits, st = _greedy(path, **kw)
    assert slow_tokens == fast_tokens == ram_tokens
    assert torch.equal(slow_logits, fast_logits) and torch.equal(slow_logits, ram_logits)
    # (the reads were streamed, and slowed: the compute thread waited on them)
    assert st["decode_bytes_read"] > 0 and st["decode_io_wait_s"] > 0
    assert st["decode_reader_busy_s"] >= 0.003
