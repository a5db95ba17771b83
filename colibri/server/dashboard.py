"""The live dashboard of `colibri serve`: `GET /dashboard` (static page, no CDN, no build step) polling
`GET /v1/colibri/stats` (JSON): tier bytes, expert-cache hit rate and bytes read over time, tok/s and TTFT
per request, and the layer x expert routing counts (docs/ROUTING.md).

The counts come from a step listener attached to the engine on the first dashboard or stats request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

STATIC = Path(__file__).parent / "dashboard"
router = APIRouter()


class DashboardFeed:
    """Step listener: routing counts per (layer, expert), per-request timings, a sampled store series."""

    def __init__(self, engine, history: int = 300, requests: int = 50):
        self.engine = engine
        self.n_experts = dict(engine._runner.n_experts)
        E = max(self.n_experts.values(), default=1)
        self.layers = sorted(self.n_experts)
        self.counts = np.zeros((len(self.layers), E), dtype=np.int64)  # [L, E] since the feed started
        self.recent = np.zeros((len(self.layers), E), dtype=np.float64)  # decayed counts (last ~50 steps)
        self.row_of = {lay: i for i, lay in enumerate(self.layers)}
        self.reqs: dict[str, dict] = {}
        self.done: deque = deque(maxlen=requests)
        self.series: deque = deque(maxlen=history)
        self.steps = 0
        self.lock = threading.Lock()
        self._last_sample = 0.0
        self.expert_bytes = _layer_expert_bytes(engine)
        engine.add_step_listener(self)

    def __call__(self, step) -> None:
        now = time.time()
        with self.lock:
            self.steps += 1
            self.recent *= 0.98
            for layer, (idx, _) in step.routes.items():
                r = self.row_of.get(layer)
                if r is not None:
                    c = np.bincount(idx.reshape(-1).cpu().numpy(), minlength=self.counts.shape[1])
                    self.counts[r] += c
                    self.recent[r] += c
            t0 = now - step.seconds
            for req, r0, r1 in step.seq_rows:
                st = self.reqs.get(req)
                if st is None:
                    st = self.reqs[req] = {"id": req, "start": t0, "prompt": 0, "generated": 0, "first": None}
                n = r1 - r0
                if n > 1 or st["prompt"] == 0:
                    st["prompt"] += n  # a prefill chunk; its end samples the first token
                    st["first"] = now
                else:
                    st["generated"] += 1  # a decode row: feeds one generated token
                st["last"] = now
            if now - self._last_sample >= 0.25:
                self._last_sample = now
                self._sample(now)

    def _sample(self, now: float) -> None:
        s = self.engine.store.stats()
        self.series.append({"t": now, "hit_rate": s.get("hit_rate", 0.0), "bytes_read": s.get("bytes_read", 0),
                            "lookups": s.get("lookups", 0)})

    def snapshot(self) -> dict:
        s = self.engine.store.stats()
        now = time.time()
        with self.lock:
            if now - self._last_sample >= 0.5:  # also between steps, so the charts advance while idle
                self._last_sample = now
                self.series.append({"t": now, "hit_rate": s.get("hit_rate", 0.0),
                                    "bytes_read": s.get("bytes_read", 0), "lookups": s.get("lookups", 0)})
        tiers = s.get("tiers", [])
        disk = sum(self.expert_bytes.get(i, 0) for i, t in enumerate(tiers) if t == "disk")
        with self.lock:
            reqs = []
            for st in list(self.reqs.values()):
                decode_s = st["last"] - st["first"]
                reqs.append({"id": st["id"], "prompt_tokens": st["prompt"], "generated": st["generated"],
                             "ttft_s": round(st["first"] - st["start"], 4),
                             "tok_s": round(st["generated"] / decode_s, 2) if decode_s > 0 else None,
                             "last_s_ago": round(now - st["last"], 1)})
            heat = {"layers": self.layers, "experts": int(self.counts.shape[1]), "counts": self.counts.tolist(),
                    "recent": np.round(self.recent, 2).tolist()}
            series = list(self.series)
            steps = self.steps
        reqs = reqs[-50:]
        return {
            "time": now, "steps": steps, "placement": s.get("placement"), "policy": s.get("policy"),
            "tiers": {"gpu": s.get("gpu_dense_bytes", 0) + s.get("gpu_expert_bytes", 0) + s.get("gpu_cache_bytes", 0),
                      "ram": s.get("resident_bytes", 0), "disk": disk},
            "store": {k: s.get(k) for k in ("hit_rate", "bytes_read", "lookups", "cache_slots", "cache_bytes",
                                            "bytes_per_token", "prefetch_precision", "prefetch_recall")},
            "health": self.engine.health(), "series": series, "requests": reqs, "heat": heat,
        }


def _layer_expert_bytes(engine) -> dict[int, int]:
    """Bytes of all routed experts of each layer, from the container's record index."""
    out: dict[int, int] = {}
    c = engine.container
    for name in c.record_names():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
            out[int(parts[2])] = out.get(int(parts[2]), 0) + c.record(name)["nbytes"]
    return out


_attach_lock = threading.Lock()


def feed_of(request: Request) -> DashboardFeed:
    app_state = request.app.state
    with _attach_lock:
        feed = getattr(app_state, "dashboard_feed", None)
        if feed is None:
            feed = app_state.dashboard_feed = DashboardFeed(app_state.colibri.engine)
    return feed


@router.get("/dashboard")
async def dashboard(request: Request) -> FileResponse:
    feed_of(request)  # start counting now, so the first requests after opening the page show up
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/dashboard/{name}")
async def dashboard_file(name: str) -> FileResponse:
    kinds = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
    if name not in kinds:
        return JSONResponse({"error": {"message": f"no dashboard file {name}", "type": "not_found"}}, 404)
    return FileResponse(STATIC / name, media_type=kinds[name])


@router.get("/v1/colibri/stats")
async def stats(request: Request) -> JSONResponse:
    return JSONResponse(feed_of(request).snapshot())
