"""A userspace delay line joining two network namespaces, for kernels without `tc netem` (sch_netem).

    delayline.py TAP_A TAP_B --netns NS [--delay-ms D]

Opens two tap devices in this namespace, moves TAP_B into NS, and copies every Ethernet frame from one to the
other D ms after it arrived (each direction a FIFO, so frames keep their order; a crossing pays D once each way, as
netem on both ends of a veth pair). A line on stdin ("0.5") sets a new delay for frames read from then on; EOF
stops it, and the taps vanish with it. It runs at SCHED_FIFO where allowed, so that a frame's release does not wait
behind the benchmark's compute threads on a 2-core machine. Needs root (/dev/net/tun, `ip`). Benchmark tooling
only (bench_cluster.py --part netem): the engine's own traffic is Ray's.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import struct
import subprocess
import sys
import time

TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def forward(a: int, b: int, delay_s: float, control) -> None:
    """Copy frames a -> b and b -> a, each `delay_s` after it was read, until `control` reaches EOF."""
    queues = {a: collections.deque(), b: collections.deque()}  # destination fd -> (due, frame)
    other = {a: b, b: a}
    ctl = control.fileno()
    while True:
        now = time.monotonic()
        due = min((q[0][0] for q in queues.values() if q), default=None)
        timeout = None if due is None else max(0.0, due - now)
        ready, _, _ = select.select([a, b, ctl], [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            if fd == ctl:
                line = control.readline()
                if not line:
                    return
                delay_s = float(line) / 1e3
                continue
            while True:  # (drain what arrived: non-blocking reads)
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                queues[other[fd]].append((now + delay_s, frame))
        for dst, q in queues.items():
            while q and q[0][0] <= now:
                os.write(dst, q.popleft()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tap_a")
    ap.add_argument("tap_b")
    ap.add_argument("--netns", required=True, help="the namespace TAP_B moves into")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    a = ap.parse_args()
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, OSError):
        pass  # (a plain process then: the figures say how far the delivered delay moved)
    fa, fb = open_tap(a.tap_a), open_tap(a.tap_b)
    subprocess.run(["ip", "link", "set", a.tap_b, "netns", a.netns], check=True, timeout=30)
    print("ready", flush=True)  # (the caller configures the addresses now)
    forward(fa, fb, a.delay_ms / 1e3, sys.stdin)


if __name__ == "__main__":
    main()
