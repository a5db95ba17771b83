"""The routing trace: which experts every token chose, for machines (`--route-trace FILE`).

JSON lines, append-only (docs/ROUTING.md). A run appends one header line, then one line per engine step:

    {"format": "colibri-route-trace", "version": 1, "session": "1733050000.123-4242", "model": "m.coli",
     "experts": {"0": 8, "1": 8}, "top_k": 2}
    {"step": 0, "kind": "prefill", "rows": [["req-1", 0, 1, "<s>"], ["req-1", 1, 351, "Once"]],
     "ids": {"0": [[3, 5], [1, 3]], "1": [[0, 6], [6, 2]]},
     "w": {"0": [[0.61, 0.39], [0.7, 0.3]], "1": [[0.52, 0.48], [0.9, 0.1]]}}

`rows` are the step's batch rows (request id, position, token id, token text), prompt rows included;
`ids[layer][r]` / `w[layer][r]` are row r's chosen experts and routing weights in that MoE layer
(router order, best first). An optional `pred[layer][r]` holds the experts layer `layer`'s router
picked from the previous layer's hidden state (the store's look-ahead), recorded by `colibri routes
--model`. A file may hold several runs: each starts with its own header. `read_trace` needs only numpy.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT, VERSION = "colibri-route-trace", 1


def step_record(step, index: int, text_of, pred: dict[int, Any] | None = None) -> dict:
    """One step (an engine StepInfo) as a JSON-able record; `text_of(token_id) -> str`."""
    rows = [[req, int(pos), int(tok), text_of(int(tok))] for req, pos, tok in step.rows]
    rec: dict[str, Any] = {"step": index, "kind": getattr(step, "kind", "decode"), "rows": rows, "ids": {}, "w": {}}
    for layer in sorted(step.routes):
        idx, w = step.routes[layer]
        rec["ids"][str(layer)] = idx.tolist()
        rec["w"][str(layer)] = [[round(float(x), 4) for x in r] for r in w.float().tolist()]
    if pred:
        rec["pred"] = {str(layer): (p.tolist() if hasattr(p, "tolist") else p) for layer, p in sorted(pred.items())}
    return rec


def header_record(model: str | None = None, experts: dict[int, int] | None = None, top_k: int | None = None,
                  expert_bytes: dict[int, int] | None = None) -> dict:
    h: dict[str, Any] = {"format": FORMAT, "version": VERSION, "session": f"{time.time():.3f}-{os.getpid()}"}
    if model is not None:
        h["model"] = str(model)
    if experts:
        h["experts"] = {str(k): int(v) for k, v in sorted(experts.items())}
    if top_k is not None:
        h["top_k"] = int(top_k)
    if expert_bytes:
        h["expert_bytes"] = {str(k): int(v) for k, v in sorted(expert_bytes.items())}
    return h


class _TokenText:
    """Token id -> its text, cached (a prefill step decodes hundreds of ids)."""

    def __init__(self, tokenizer):
        self.tok, self.memo = tokenizer, {}

    def __call__(self, tid: int) -> str:
        s = self.memo.get(tid)
        if s is None:
            s = self.memo[tid] = self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else ""
        return s


class RouteTraceWriter:
    """A step listener (`Engine.add_step_listener(writer)`) appending every step to a trace file.

    `RouteTraceWriter(path, tokenizer)`; `experts` ({MoE layer: experts}) and `model` label the header.
    `prediction`, when given, is called once per step and returns {layer: ids [R, k]} look-ahead picks.
    Each step is one line written and flushed at once, so a crash loses at most the step in flight."""

    def __init__(self, path: str | os.PathLike, tokenizer=None, *, experts: dict[int, int] | None = None,
                 model: str | None = None, top_k: int | None = None, prediction=None):
        self.path = Path(path)
        self.text_of = _TokenText(tokenizer)
        self.prediction = prediction
        self.header = header_record(model, experts, top_k)
        self._lock = threading.Lock()
        self._n = 0
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held until close()
        self._write(self.header)

    def _write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def __call__(self, step) -> None:
        pred = self.prediction() if self.prediction is not None else None
        if not step.rows:
            return
        with self._lock:
            if self._f is None:
                return
            self._write(step_record(step, self._n, self.text_of, pred))
            self._n += 1

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


class RouteCollector:
    """The same records as RouteTraceWriter, kept in memory (`colibri routes --model`)."""

    def __init__(self, tokenizer=None, *, experts: dict[int, int] | None = None, model: str | None = None,
                 top_k: int | None = None, expert_bytes: dict[int, int] | None = None, prediction=None):
        self.text_of = _TokenText(tokenizer)
        self.prediction = prediction
        self.header = header_record(model, experts, top_k, expert_bytes)
        self.records: list[dict] = []

    def __call__(self, step) -> None:
        pred = self.prediction() if self.prediction is not None else None
        if step.rows:
            self.records.append(step_record(step, len(self.records), self.text_of, pred))

    def trace(self) -> RouteTrace:
        return RouteTrace.from_records([self.header, *self.records])


# ---------------------------------------------------------------------- reading


@dataclass
class RouteTrace:
    """A trace as arrays, one entry per row (token) in file order.

    `req[i]` request id (prefixed "runN/" from a file's second run on), `pos`, `tok`, `text`, `step`
    (a global step counter), `ids[layer]` [N, k] int, `w[layer]` [N, k] float, `pred[layer]` [N, k]
    (-1 where not recorded), `experts[layer]` experts of the layer (from the header, else max id + 1)."""

    req: list[str]
    pos: np.ndarray
    tok: np.ndarray
    text: list[str]
    step: np.ndarray
    ids: dict[int, np.ndarray]
    w: dict[int, np.ndarray]
    pred: dict[int, np.ndarray] = field(default_factory=dict)
    experts: dict[int, int] = field(default_factory=dict)
    headers: list[dict] = field(default_factory=list)
    expert_bytes: dict[int, int] = field(default_factory=dict)  # bytes one expert read costs (when known)

    @property
    def layers(self) -> list[int]:
        return sorted(self.ids)

    @property
    def n_rows(self) -> int:
        return len(self.pos)

    @property
    def top_k(self) -> int:
        return next(iter(self.ids.values())).shape[1] if self.ids else 0

    def sequences(self) -> list[np.ndarray]:
        """Row indices of each request, in position order (for consecutive-token statistics)."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(self.req):
            groups.setdefault(r, []).append(i)
        out = []
        for rows in groups.values():
            a = np.asarray(rows)
            out.append(a[np.argsort(self.pos[a], kind="stable")])
        return out

    @classmethod
    def from_records(cls, records: list[dict], where: str = "trace") -> RouteTrace:
        from ..errors import ColibriError

        req, pos, tok, text, step = [], [], [], [], []
        ids: dict[int, list] = {}
        w: dict[int, list] = {}
        pred: dict[int, list[tuple[int, list]]] = {}
        experts: dict[int, int] = {}
        nbytes: dict[int, int] = {}
        headers: list[dict] = []
        run, n_steps = 0, 0
        for n, rec in enumerate(records):
            if rec.get("format") == FORMAT:
                if rec.get("version") != VERSION:
                    raise ColibriError(f"{where}: route trace version {rec.get('version')} is not supported")
                headers.append(rec)
                run += 1
                experts.update({int(k): int(v) for k, v in rec.get("experts", {}).items()})
                nbytes.update({int(k): int(v) for k, v in rec.get("expert_bytes", {}).items()})
                continue
            if not headers:
                raise ColibriError(f"{where}: not a colibri route trace (no header line)")
            try:
                r0 = len(pos)
                for rq, p, t, *txt in rec["rows"]:
                    req.append(rq if run == 1 else f"run{run}/{rq}")
                    pos.append(p)
                    tok.append(t)
                    text.append(txt[0] if txt else "")
                    step.append(n_steps)
                for k, v in rec["ids"].items():
                    layer = int(k)
                    if len(v) != len(rec["rows"]):
                        raise ValueError(f"layer {layer} has {len(v)} rows, the step {len(rec['rows'])}")
                    if layer not in ids and r0:
                        raise ValueError(f"layer {layer} first appears mid-trace")
                    ids.setdefault(layer, []).extend(v)
                    w.setdefault(layer, []).extend(rec["w"][k])
                for k, v in rec.get("pred", {}).items():
                    pred.setdefault(int(k), []).append((r0, v))
            except (KeyError, TypeError, ValueError) as e:
                raise ColibriError(f"{where}: line {n + 1}: corrupt route trace record ({e})") from None
            n_steps += 1
        if not headers:
            raise ColibriError(f"{where}: not a colibri route trace (empty)")
        N = len(pos)
        ids_a = {k: np.asarray(v, dtype=np.int64).reshape(N, -1) for k, v in ids.items()}
        w_a = {k: np.asarray(v, dtype=np.float32).reshape(N, -1) for k, v in w.items()}
        pred_a = {}
        for layer, parts in pred.items():
            k = ids_a[layer].shape[1] if layer in ids_a else len(parts[0][1][0])
            a = np.full((N, k), -1, dtype=np.int64)
            for r0, v in parts:
                a[r0 : r0 + len(v)] = np.asarray(v, dtype=np.int64).reshape(len(v), -1)[:, :k]
            pred_a[layer] = a
        for layer, a in ids_a.items():
            experts.setdefault(layer, int(a.max()) + 1 if a.size else 0)
        return cls(req, np.asarray(pos, dtype=np.int64), np.asarray(tok, dtype=np.int64), text,
                   np.asarray(step, dtype=np.int64), ids_a, w_a, pred_a, experts, headers, nbytes)


def read_trace(path: str | os.PathLike) -> RouteTrace:
    """Read a trace file (all runs in it). A truncated last line (a crash mid-write) is skipped."""
    from ..errors import ColibriError

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ColibriError(f"cannot read route trace {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ColibriError(f"{path} is not a route trace (not UTF-8 text)") from None
    records = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break
            raise ColibriError(f"{path}: line {n + 1} is not JSON (not a route trace?)") from None
    return RouteTrace.from_records(records, str(path))
