"""Fuzz: seeded mutants of small valid containers and HF folders through open, inspect, run and convert.

Every case must end in a one-line `colibri: error:` with a non-zero exit, or a documented acceptance
(docs/FORMAT.md, "What a reader accepts"): bytes the format ignores give the same output, and a
self-consistent rewritten header (one that `colibri inspect` accepts in full) is a different model.
Never a traceback, a hang, a signal, or changed output from damaged bytes.

The cases run in one worker process (tests/fuzz_worker.py) that this test restarts when a case hangs
(time- and memory-bounded) or dies. The default 128 cases take ~60-85 s on a busy 2-core machine (about
0.5 s a case plus ~20 s of setup); `COLIBRI_FUZZ_CASES=1000` runs a longer campaign (~14 min there) with
new seeds; `COLIBRI_FUZZ_REPORT=path.json` writes the per-category counts.
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fuzz_mutants import CONTAINER_CATEGORIES, CORRUPTION, HF_CATEGORIES

from colibri.convert.converter import convert

ROOT = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("COLIBRI_FUZZ_CASES", "128"))
CASE_TIMEOUT_S = float(os.environ.get("COLIBRI_FUZZ_TIMEOUT", "20"))
MAX_RSS = 3 << 30  # a worker past this is "hang" (unbounded growth), killed before it hurts the machine
HF_SHARE = 0.2  # HF cases cost a conversion each
MODES = ("mapped", "budget", "disk")


class Pool:
    """One worker process, restarted after a hang or a crash."""

    def __init__(self, setup: dict, log: Path):
        self.setup, self.log, self.p = setup, log, None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fuzz_worker.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=open(self.log, "ab"), env=env, text=True)
        self.p.stdin.write(json.dumps(self.setup) + "\n")
        self.p.stdin.flush()
        got = self._read(120)
        assert got == {"ready": True}, f"fuzz worker did not start: {got} (see {self.log})"

    def _read(self, timeout: float) -> dict | str:
        deadline = time.monotonic() + timeout
        proc = psutil.Process(self.p.pid)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "hang"
            ready, _, _ = select.select([self.p.stdout], [], [], min(left, 0.2))
            if ready:
                line = self.p.stdout.readline()
                if not line:
                    self.p.wait(10)
                    return f"signal (exit {self.p.returncode})"
                return json.loads(line)
            try:
                if proc.memory_info().rss > MAX_RSS:
                    return "hang (memory)"
            except psutil.NoSuchProcess:
                return "signal"

    def run(self, req: dict) -> dict:
        if self.p is None:
            self.start()
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            got: dict | str = "signal (broken pipe)"
        else:
            got = self._read(CASE_TIMEOUT_S)
        if isinstance(got, str):
            self.stop()
            return {"desc": "?", "fatal": got}
        return got

    def stop(self) -> None:
        if self.p is not None:
            self.p.kill()
            self.p.wait()
            self.p = None


def verdict(category: str, r: dict) -> str:
    """The case's class: error / same / ok / changed-consistent (accepted), or `FAIL ...`."""
    if "harness" in r:
        return f"FAIL harness {r['harness']}"
    if "fatal" in r:
        return f"FAIL {r['fatal']}"
    stages = [r.get(k) for k in ("convert", "open", "inspect", "run") if k in r]
    bad = [s for s in stages if s.startswith("traceback")]
    if bad:
        return f"FAIL {bad[0]}"
    if category.startswith("hf_"):
        if r["convert"] == "error":
            return "error"
        if "nan in" in r["desc"] or "inf in" in r["desc"]:
            return "FAIL non-finite weights converted"
        if r["open"] != "ok" or r["inspect"] != "ok" or r["run"] == "error":
            return "FAIL converted, then refused at run time"
        if r["run"] == "changed" and category != "hf_config":
            return "FAIL converted with changed output"
        return "changed-consistent" if r["run"] == "changed" else "same"
    if r["run"] == "changed":
        if category in CORRUPTION:
            return "FAIL changed output from damaged bytes"
        if r["inspect"] != "ok":
            return "FAIL changed output from a file inspect refuses"
        return "changed-consistent"
    return "error" if r["run"] == "error" else r["run"]


def plan_cases(n: int) -> list[dict]:
    """Round-robin over categories, bases and modes; seeds make every case reproducible."""
    n_hf = int(n * HF_SHARE)
    cases = []
    bases = ("bf16", "int8", "int4")
    for i in range(n - n_hf):
        cat = CONTAINER_CATEGORIES[i % len(CONTAINER_CATEGORIES)]
        cases.append({"kind": "container", "category": cat, "seed": i, "base": bases[(i // 10) % 3],
                      "mode": MODES[(i // 30) % 3]})
    for i in range(n_hf):
        cases.append({"kind": "hf", "category": HF_CATEGORIES[i % len(HF_CATEGORIES)], "seed": i, "base": "",
                      "mode": MODES[(i // 4) % 3]})
    return cases


@pytest.fixture(scope="module")
def pool(ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    hf = ckpt.hf("mixtral")
    bases = {s: str(convert(hf, tmp / f"base-{s}.coli", s, 32, progress=False)) for s in ("bf16", "int8", "int4")}
    p = Pool({"bases": bases, "hf_base": str(hf), "tmp": str(tmp)}, tmp / "worker.log")
    yield p
    p.stop()


def test_fuzz_containers_and_hf_folders(pool):
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    t0 = time.perf_counter()
    for case in plan_cases(CASES):
        r = pool.run(case)
        v = verdict(case["category"], r)
        counts[case["category"]][v.split(" ")[0] if not v.startswith("FAIL") else v[:40]] += 1
        if v.startswith("FAIL"):
            failures.append((case, r.get("desc"), v))
    elapsed = time.perf_counter() - t0
    table = {k: dict(v) for k, v in sorted(counts.items())}
    print(f"\nfuzz: {CASES} cases in {elapsed:.1f}s")
    for cat, c in table.items():
        print(f"  {cat:16s} {c}")
    if out := os.environ.get("COLIBRI_FUZZ_REPORT"):
        Path(out).write_text(json.dumps({"cases": CASES, "seconds": elapsed, "counts": table,
                                         "failures": [[c, d, v] for c, d, v in failures]}, indent=1))
    assert not failures, f"{len(failures)} failing cases, e.g.\n" + "\n".join(
        f"{c['category']} seed {c['seed']} {c['base']} {c['mode']}: {d}: {v}" for c, d, v in failures[:15])
