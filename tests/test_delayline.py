"""benchmarks/delayline.py, the userspace delay line bench_cluster.py --part netem joins a network namespace through
where the kernel has no sch_netem: frames cross both ways, and none crosses sooner than the delay set (a TCP echo's
round trip pays it twice). Runs where this process may create network namespaces and tap devices (root,
/dev/net/tun, `ip`); the namespace and subnet are its own, removed at the end."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

LINE = Path(__file__).resolve().parents[1] / "benchmarks" / "delayline.py"
NS, HOST, PEER = f"colibri-t{os.getpid()}", "10.203.7.1", "10.203.7.2"
ECHO = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('{PEER}', 0)); s.listen(); print(s.getsockname()[1], flush=True)\nc, _ = s.accept()\n"
        "while (d := c.recv(65536)): c.sendall(d)\n")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/net/tun") or shutil.which("ip") is None,
    reason="needs root, /dev/net/tun and iproute2 (network namespaces and tap devices)")


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _round_trip(c: socket.socket) -> float:
    t = time.perf_counter()
    c.sendall(b"x" * 64)
    got = 0
    while got < 64:
        got += len(c.recv(4096))
    return time.perf_counter() - t


def test_frames_cross_both_ways_never_sooner_than_the_delay() -> None:
    tap_a, tap_b = f"ct{os.getpid() % 10000}a", f"ct{os.getpid() % 10000}b"
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    _sh("ip", "netns", "add", NS)
    line = echo = None
    try:
        line = subprocess.Popen([sys.executable, str(LINE), tap_a, tap_b, "--netns", NS], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert line.stdout.readline().strip() == "ready"
        _sh("ip", "addr", "add", f"{HOST}/24", "dev", tap_a)
        _sh("ip", "link", "set", tap_a, "up")
        for cmd in (["addr", "add", f"{PEER}/24", "dev", tap_b], ["link", "set", tap_b, "up"]):
            _sh("ip", "netns", "exec", NS, "ip", *cmd)
        echo = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", ECHO], stdout=subprocess.PIPE,
                                text=True)
        port = int(echo.stdout.readline())
        with socket.create_connection((PEER, port), timeout=10) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.settimeout(10)
            _round_trip(c)  # (through the line at 0 ms)
            line.stdin.write("25\n")  # 25 ms each way from now on
            line.stdin.flush()
            time.sleep(0.1)
            trips = [_round_trip(c) for _ in range(3)]
        assert min(trips) >= 0.050, trips  # (a frame is held 25 ms each way: a round trip cannot take less)
    finally:
        if echo is not None:
            echo.kill()
            echo.wait(10)
        if line is not None:
            line.stdin.close()  # (EOF stops it; its taps go with it)
            line.wait(10)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tap_a not in links
