"""Running the server: load the engine, serve with uvicorn, drain on SIGINT/SIGTERM, close the engine."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

import uvicorn

from ..errors import ColibriError
from .app import ServerState, create_app, default_model_id

log = logging.getLogger("colibri.server")


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGINT/SIGTERM drains: the server keeps answering (503 for new
    requests, /health says shutting_down) until running requests end or `grace` seconds pass, then
    exits. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float):
        super().__init__(config)
        self.state, self.drain_since, self.grace = state, None, grace

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:
            self.state.cancel_all()
            self.should_exit = self.force_exit = True
            return
        self.state.draining, self.drain_since = True, time.monotonic()
        print(f"colibri: {signal.Signals(sig).name}: finishing {len(self.state.inflight)} running request(s), "
              "refusing new ones", file=sys.stderr, flush=True)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_since is not None and not self.should_exit:
            if not self.state.inflight:
                self.should_exit = True
            elif time.monotonic() - self.drain_since > self.grace:
                self.state.cancel_all()  # their streams end with an error event; then the next tick exits
                self.drain_since = time.monotonic() - self.grace + 1.0
        return await super().on_tick(counter)


def serve(a: argparse.Namespace) -> int:
    from ..cli.common import engine_from_args, setup_logging
    from ..cli.specflags import apply_spec_args

    setup_logging(a.log_level)
    t0 = time.perf_counter()
    slot_dir = None
    if a.slot_save_path is not None:
        slot_dir = Path(a.slot_save_path)
        try:
            slot_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ColibriError(f"--slot-save-path {slot_dir}: {e.strerror or e}") from None
    engine = engine_from_args(a)
    apply_spec_args(engine, a)
    try:
        origins = [o.strip() for o in (a.allowed_origins or "").split(",") if o.strip()]
        state = ServerState(engine, a.model_id or default_model_id(a.model), a.api_key, slot_dir,
                            a.reasoning_format == "deepseek", origins,
                            None if a.tool_parser == "auto" else a.tool_parser)
        config = uvicorn.Config(create_app(state), host=a.host, port=a.port, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5)
        server = _DrainingServer(config, state, float(a.shutdown_grace))
        print(f"colibri: serving '{state.model_id}' ({engine.n_slots} slots x {engine.ctx_size} ctx, "
              f"KV cache {engine.kv_bytes() / 2**20:.0f} MiB {engine.kv_types}, loaded in "
              f"{time.perf_counter() - t0:.1f} s) on http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)
        try:
            server.run()
        except SystemExit:  # uvicorn exits when it cannot bind (it has logged why)
            if server.started:
                raise
        if not server.started:
            raise ColibriError(f"cannot listen on {a.host}:{a.port} (in use, or not an address of this machine)")
    finally:
        engine.close()
    print("colibri: server stopped", file=sys.stderr, flush=True)
    return 0
