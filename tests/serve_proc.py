"""A real `colibri serve` process on a free 127.0.0.1 port, for the server and dashboard tests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str):
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        # The log goes to a file: a pipe nobody reads fills after ~400 logged requests (64 KiB), and the
        # server's event loop then blocks in its next log write (every request hung, seen in a stress run).
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "colibri", "serve", "--model", str(model), "--port",
                                      str(self.port), "--threads", "1", *args], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict | str]:
        """(status, parsed JSON, or the text of a non-JSON answer such as the dashboard page)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        if "json" not in r.getheader("content-type", "json"):
            return r.status, raw.decode()
        return r.status, json.loads(raw) if raw else {}

    def output(self) -> str:
        """What the server has printed so far (stdout and stderr)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        """SIGTERM (SIGKILL after 30 s); returns what the server printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        out = self.output()
        self.log.close()
        return out
