"""The fuzz worker: one process that runs mutant cases in-process and answers one JSON line per case.

Started by tests/test_fuzz.py (`python tests/fuzz_worker.py`), which owns the timeouts: a case that
hangs, eats memory or kills this process is recorded there as `hang` / `signal` and the worker is
restarted. Protocol: the first stdin line is the setup (bases, HF base folder, scratch dir); every
further line is a case `{"kind", "base", "category", "seed", "mode"}`; each answer is one JSON line on
the original stdout (the process's fd 1 is pointed at stderr so stray prints cannot break the protocol).

A stage's outcome is `ok` / `same` / `changed` (with the CLI's exit 0), `error` (exit 1 with exactly one
`colibri: error:` line and no traceback), or `traceback: <type>: <message>`.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import random
import sys
import traceback
from pathlib import Path

_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

torch.set_num_threads(1)

from fuzz_mutants import container_mutant, hf_mutant  # noqa: E402

from colibri.cli import main as cli  # noqa: E402
from colibri.convert.converter import convert  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.format.container import Container  # noqa: E402

MODES = {"mapped": ["--mmap"], "budget": ["--mem-budget", "64M"], "disk": ["--gpu-layers", "0", "--ram-layers", "0"]}


def _cli(argv: list[str]) -> tuple[str, str]:
    """(outcome, stdout) of one in-process CLI call; outcome is ok / error / traceback: ..."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli(argv)
    except BaseException as e:  # noqa: BLE001 - what the CLI would have shown as a traceback
        return f"traceback: {type(e).__name__}: {str(e)[:200]}", out.getvalue()
    finally:
        gc.collect()
    lines = err.getvalue().splitlines()
    errors = [ln for ln in lines if ln.startswith("colibri: error:")]
    if rc == 0:
        return "ok", out.getvalue()
    if len(errors) == 1 and not any("Traceback" in ln for ln in lines):
        return "error", errors[0]
    return f"traceback: rc {rc}, stderr {err.getvalue()[-300:]!r}", out.getvalue()


def run_args(path: str, mode: str) -> list[str]:
    return ["--model", path, "--prompt", "Hello", "-n", "2", "--temp", "0", "--threads", "1", "--ctx-size", "32",
            "--no-stats", *MODES[mode]]


def check_file(path: str, baseline: str | None, mode: str) -> dict:
    res: dict = {}
    try:
        Container(path).close()
        res["open"] = "ok"
    except ColibriError as e:
        res["open"] = "error"
        res["open_msg"] = str(e)
    except BaseException as e:  # noqa: BLE001
        res["open"] = f"traceback: {type(e).__name__}: {str(e)[:200]}"
    res["inspect"], msg = _cli(["inspect", path])
    if res["inspect"] == "error":
        res["inspect_msg"] = msg
    outcome, text = _cli(run_args(path, mode))
    if outcome == "ok":
        outcome = "same" if text == baseline else "changed" if baseline is not None else "ok"
    elif outcome == "error":
        res["run_msg"] = text
    res["run"] = outcome
    return res


class Worker:
    def __init__(self, setup: dict):
        self.bases: dict[str, str] = setup["bases"]
        self.blobs = {k: Path(v).read_bytes() for k, v in self.bases.items()}
        self.hf_base = Path(setup["hf_base"])
        self.tmp = Path(setup["tmp"])
        self.baseline: dict[tuple[str, str], str] = {}

    def base_output(self, key: str, path: str, mode: str) -> str:
        if (key, mode) not in self.baseline:
            outcome, text = _cli(run_args(path, mode))
            if outcome != "ok":
                raise RuntimeError(f"the unmodified {path} does not run ({mode}): {outcome} {text}")
            self.baseline[key, mode] = text
        return self.baseline[key, mode]

    def case(self, req: dict) -> dict:
        rng = random.Random(f"{req['category']}:{req['seed']}")
        mode = req["mode"]
        if req["kind"] == "container":
            desc, blob = container_mutant(self.blobs[req["base"]], req["category"], rng)
            path = self.tmp / f"mutant-{os.getpid()}.coli"
            path.write_bytes(blob)
            base = self.base_output(req["base"], self.bases[req["base"]], mode)
            return {"desc": desc, **check_file(str(path), base, mode)}
        folder = self.tmp / f"hf-{os.getpid()}"
        desc, scheme, gs = hf_mutant(self.hf_base, folder, req["category"], rng)
        base_path = self.tmp / f"hf-base-{scheme}-{gs}.coli"
        base: str | None = None
        try:
            if not base_path.exists():
                convert(self.hf_base, base_path, scheme, gs or 64, progress=False)
            base = self.base_output(f"hf-{scheme}-{gs}", str(base_path), mode)
        except ColibriError:  # e.g. a group size the base model refuses too: nothing to compare with
            pass
        out = self.tmp / f"hf-{os.getpid()}.coli"
        out.unlink(missing_ok=True)
        argv = ["convert", "-i", str(folder), "-o", str(out), "--quant", scheme, "--no-progress"]
        if gs:
            argv += ["--group-size", str(gs)]
        res: dict = {"desc": f"{desc} ({scheme}{'/g' + str(gs) if gs else ''})"}
        res["convert"], msg = _cli(argv)
        if res["convert"] == "error":
            res["convert_msg"] = msg
        if res["convert"] == "ok":
            res.update(check_file(str(out), base, mode))
        return res


def main() -> None:
    worker = Worker(json.loads(sys.stdin.readline()))
    _proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            res = worker.case(req)
        except BaseException as e:  # noqa: BLE001 - a harness failure, reported as such
            res = {"desc": "?", "harness": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        _proto.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
