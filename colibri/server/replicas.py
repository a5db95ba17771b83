"""`colibri serve --replicas N`: N whole engines behind one OpenAI endpoint, through Ray Serve.

Each replica is a Ray Serve replica (one per node offering `colibri`) running the app `colibri serve` runs
(server/app.py) over its own engine, built from the same flags; Serve's proxy on this machine spreads the requests
over them. `/health` and `/metrics` answer for all of them: every replica posts its figures each second to one
named board actor, and those two routes read the board (a replica silent for BOARD_STALE_S is reported as down,
and /health as degraded).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
import time

from ..errors import ColibriError

log = logging.getLogger("colibri.server")

BOARD = "colibri-replica-board"
BOARD_EVERY_S = 1.0
BOARD_STALE_S = 5.0


class Board:
    """The replicas' latest health and Prometheus text (a Ray actor)."""

    def __init__(self):
        self.rows: dict[str, tuple[float, dict, str]] = {}

    def put(self, replica: str, health: dict, metrics: str) -> None:
        self.rows[replica] = (time.time(), health, metrics)

    def get(self) -> dict[str, tuple[float, dict, str]]:
        return self.rows


def build_app(a: argparse.Namespace):
    """On a replica: its engine (from `colibri serve`'s flags `a`), the server's app over it, and the replicas'
    /health and /metrics in front."""
    import ray
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST

    from ..cli.common import engine_from_args
    from ..cli.specflags import apply_spec_args
    from .app import ServerState, create_app, default_model_id

    engine = engine_from_args(a)
    apply_spec_args(engine, a)
    state = ServerState(engine, a.model_id or default_model_id(a.model), a.api_key, None,
                        a.reasoning_format == "deepseek", [o.strip() for o in (a.allowed_origins or "").split(",")
                                                           if o.strip()],
                        None if a.tool_parser == "auto" else a.tool_parser)
    board = ray.get_actor(BOARD)
    me = ray.get_runtime_context().get_actor_id()[:12]

    def post() -> None:
        while True:
            try:
                ray.get(board.put.remote(me, engine.health(), state.metrics.render().decode()), timeout=BOARD_STALE_S)
            except Exception as e:  # noqa: BLE001 - the board is for watching: serving goes on without it
                log.warning("colibri: replica %s could not post to the board: %s", me, e)
            time.sleep(BOARD_EVERY_S)

    threading.Thread(target=post, name="colibri-board", daemon=True).start()
    outer = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @outer.get("/health")
    async def health() -> JSONResponse:
        rows = await asyncio.wait_for(board.get.remote(), BOARD_STALE_S)
        now = time.time()
        live = {r: h for r, (t, h, _) in rows.items() if now - t < BOARD_STALE_S}
        out = {"status": "ok" if live and len(live) == len(rows) else "degraded", "replicas": len(live),
               "replicas_down": sorted(set(rows) - set(live))}
        for key in ("slots", "busy", "free", "queued"):
            out[key] = sum(h.get(key, 0) for h in live.values())
        out["per_replica"] = live
        return JSONResponse(out)

    @outer.get("/metrics")
    async def metrics() -> Response:
        rows = await asyncio.wait_for(board.get.remote(), BOARD_STALE_S)
        return Response(merge_metrics({r: m for r, (_, _, m) in rows.items()}), media_type=CONTENT_TYPE_LATEST)

    outer.mount("/", create_app(state))
    return outer


def merge_metrics(texts: dict[str, str]) -> bytes:
    """The replicas' Prometheus texts as one, every sample labelled with its replica."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    class Replicas:
        def collect(self):
            merged: dict[str, Metric] = {}
            for replica, text in sorted(texts.items()):
                for fam in text_string_to_metric_families(text):
                    out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                    for s in fam.samples:
                        out.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
            yield from merged.values()

    reg = CollectorRegistry()
    reg.register(Replicas())
    return generate_latest(reg)


def serve_replicas(a: argparse.Namespace) -> int:
    """Start Ray Serve on the cluster (or a local Ray of N `colibri` units), deploy the replicas, wait for them,
    serve until SIGINT/SIGTERM, then take the replicas down."""
    from ..cluster import nodes

    r = nodes.ray()
    try:
        from ray import serve
    except ImportError:
        raise ColibriError("--replicas needs Ray Serve: pip install 'colibri[cluster]'") from None
    if a.cluster is not None:
        nodes.connect(a.cluster)
    else:  # this machine alone: a local Ray with one `colibri` unit a replica
        r.init(resources={nodes.RESOURCE: a.replicas}, log_to_driver=False, include_dashboard=False,
               logging_level=logging.WARNING)
    have = sum(n.get("Resources", {}).get(nodes.RESOURCE, 0) for n in r.nodes() if n.get("Alive"))
    if have < a.replicas:
        raise ColibriError(f"--replicas {a.replicas}: the cluster offers {int(have)} unit(s) of '{nodes.RESOURCE}' "
                           "(one a replica)")
    stop = threading.Event()  # (before Serve starts: a signal while the replicas load still stops cleanly)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # each replica: one whole engine on its node, from the same flags
    inner = argparse.Namespace(**{**vars(a), "replicas": None, "cluster": None})
    board = r.remote(Board).options(name=BOARD, get_if_exists=True, num_cpus=0).remote()
    serve.start(http_options={"host": a.host, "port": a.port}, proxy_location="HeadOnly")
    app = serve.deployment(serve.ingress(lambda: build_app(inner))(), name="colibri", num_replicas=a.replicas,
                           max_ongoing_requests=max(2 * a.slots, 8),
                           ray_actor_options={"num_cpus": 0, "resources": {nodes.RESOURCE: 1}})
    t0 = time.perf_counter()
    try:
        serve.run(app.bind(), name="colibri", route_prefix="/")
    except Exception as e:  # noqa: BLE001 - a replica failed to load: one line
        serve.shutdown()
        raise ColibriError(f"--replicas: the replicas did not start: {str(e).splitlines()[0][:300]}") from None
    print(f"colibri: serving {a.replicas} replica(s) of {a.model or 'the demo model'} (loaded in "
          f"{time.perf_counter() - t0:.1f} s) on http://{a.host}:{a.port}/v1 through Ray Serve", file=sys.stderr,
          flush=True)
    stop.wait()
    print("colibri: stopping the replicas", file=sys.stderr, flush=True)
    serve.shutdown()
    r.kill(board)
    print("colibri: server stopped", file=sys.stderr, flush=True)
    return 0
