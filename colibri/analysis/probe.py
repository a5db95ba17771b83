"""What the planner needs to know about this machine: free memory and VRAM, and three speeds.

- disk: random O_DIRECT reads of expert-record size from the container itself, as many at a time
  as the store's reader runs (its threads);
- weights through a matrix-vector product (bytes/s): what a decode token's matmuls sustain,
  in the model's own scheme and compute dtype (memory bandwidth or the kernel's limit);
- one torch operation on a tiny tensor (seconds): the fixed cost a small model pays hundreds
  of times per token, whatever its bytes.
Each probe runs a fraction of a second; nothing here reads the container's header or decides.
"""

from __future__ import annotations

import mmap
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

GiB, MiB = 1 << 30, 1 << 20
RAM_BPS = 18e9  # weights/s a decode step sustains when not measured (STREAM-like, this machine class)


@dataclass
class Machine:
    mem_available: int
    mem_free: int
    vram_free: int | None  # None: no CUDA device
    disk_bps: float
    ram_bps: float = RAM_BPS
    disk_note: str = "given"
    op_s: float = 0.0  # one small torch op (0: not measured, overhead left out of the speed estimate)
    ram_note: str = "assumed"
    cgroup: bool = False  # mem_available is a memory cgroup's limit (a container's), tighter than the host's


def physical_cores() -> int:
    """Physical cores (hyper-threads share the FPU, so more threads than this rarely helps)."""
    try:
        pairs = set()
        phys = core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                pairs.add((phys, core))
        return max(len(pairs), 1) if pairs else (os.cpu_count() or 1)
    except OSError:
        return os.cpu_count() or 1


def peak_rss_mib() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the parent."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as ~2^63 (rounded to pages)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str, keys: tuple[str, ...]) -> int:
    """The first of `keys` in a cgroup memory.stat file (bytes), 0 when absent."""
    fields = dict(ln.split(None, 1) for ln in (_read(path) or "").splitlines() if " " in ln)
    return next((int(fields[k]) for k in keys if k in fields), 0)


def cgroup_free(proc_self: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (or the tightest of its ancestors) still allows: its limit less
    what it holds, its page cache counted as free (the kernel reclaims it before an OOM kill, as
    MemAvailable counts it); None where no limit applies. A container's memory limit (docker --memory,
    Kubernetes, systemd's MemoryMax, ../shared/tools/memcap) is not in /proc/meminfo, whose
    MemAvailable is the host's: a plan from it alone got the process OOM-killed. cgroup v1's memory
    controller where the process has one, else v2's."""
    lines = [ln.split(":", 2) for ln in (_read(proc_self) or "").splitlines() if ln.count(":") >= 2]
    v1 = next((p for hid, ctrls, p in lines if hid != "0" and "memory" in ctrls.split(",")), None)
    if v1 is not None and os.path.isdir(os.path.join(root, "memory")):
        base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        path, cache = v1, ("total_cache", "cache")
    else:
        path = next((p for hid, ctrls, p in lines if hid == "0" and ctrls == ""), None)
        if path is None:
            return None
        base, files, cache = root, ("memory.max", "memory.current"), ("file",)
    best = None
    while True:
        d = os.path.join(base, path.strip("/"))
        limit, used = _read(os.path.join(d, files[0])), _read(os.path.join(d, files[1]))
        if limit is not None and limit.isdigit() and int(limit) < NO_LIMIT and used is not None and used.isdigit():
            free = min(max(int(limit) - int(used) + _stat(os.path.join(d, "memory.stat"), cache), 0), int(limit))
            best = free if best is None else min(best, free)
        if path.strip("/") == "":
            return best
        path = os.path.dirname(path.rstrip("/")) or "/"


def mem_available() -> tuple[int, bool]:
    """Memory this process may still take: MemAvailable, or less where its cgroup's limit says so; and
    whether the cgroup's is the tighter."""
    avail, cg = meminfo().get("MemAvailable", 0), cgroup_free()
    return (avail, False) if cg is None or cg >= avail else (cg, True)


def measure_disk(path: str, seconds: float = 0.5, chunk: int = 4 * MiB,
                 threads: int | None = None) -> tuple[float, str]:
    """Read speed of `path`'s device: random aligned O_DIRECT reads of expert-record size, issued
    by `threads` readers at once (default: as many as the store's reader threads, store/reader.py
    IO_THREADS), the queue depth the store reads at (SSDs need queue depth to reach speed).

    O_DIRECT bypasses the page cache, so this is the device, not RAM, whatever was read before.
    Falls back to buffered reads where O_DIRECT is refused (tmpfs), and says so.
    """
    import random
    from concurrent.futures import ThreadPoolExecutor

    from ..store.reader import IO_THREADS  # (late: the store package imports torch)

    threads = IO_THREADS if threads is None else threads
    size = os.path.getsize(path)
    chunk = max(4096, min(chunk, size) // 4096 * 4096)
    note = "O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd, note = os.open(path, os.O_RDONLY), "buffered (O_DIRECT refused; may be page-cache speed)"
    slots = max(size // chunk - 1, 1)
    deadline = time.perf_counter() + seconds

    def reader(seed: int) -> int:
        buf, rng, done = mmap.mmap(-1, chunk), random.Random(seed), 0  # page-aligned, as O_DIRECT requires
        try:
            while time.perf_counter() < deadline:
                done += os.preadv(fd, [buf], rng.randrange(slots) * chunk)
        finally:
            buf.close()
        return done

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(reader, range(threads)))
    except OSError:  # O_DIRECT refused at the first read (some filesystems): measure buffered
        os.close(fd)
        fd, note = os.open(path, os.O_RDONLY), "buffered (O_DIRECT failed; may be page-cache speed)"
        deadline, t0 = time.perf_counter() + seconds, time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(reader, range(threads)))
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    depth = f"{threads} at a time" + (", as many as the store's reader threads" if threads == IO_THREADS else "")
    size = f"{chunk / MiB:.1f} MiB" if chunk >= MiB else f"{chunk // 1024} KiB"
    return (done / dt if dt > 0 else 0.0), f"{note}, {seconds:.1f} s of {size} random reads, {depth}"


def measure_op(seconds: float = 0.5) -> float:
    """Seconds of one torch op on a tiny tensor, averaged over `seconds`: on a busy machine the
    average, like a decode run, includes the time other programs take the CPU away."""
    import torch

    a, b = torch.zeros(1, 128), torch.zeros(1, 128)
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        for _ in range(200):
            torch.add(a, b)
        n += 200
    return dt / n


def measure_matvec(scheme: str, seconds: float = 0.2, weight_mib: int = 48) -> float:
    """Bytes/s of stored weights a one-row matmul streams, in `scheme` (the model's) and its compute
    dtype: what a decode token's expert and dense matmuls sustain. The weights (`weight_mib` MiB in
    the compute dtype, cycled) exceed the CPU caches, as a real model's do."""
    import torch

    from ..quant import QLinear

    dtype = torch.float32 if scheme == "f32" else torch.bfloat16
    out, n_in = 2048, 4096
    n = max(1, (weight_mib * MiB) // (out * n_in * dtype.itemsize))
    g = 64 if scheme in ("int4", "int2", "int3") else 0
    mods = [QLinear.from_dense(torch.randn(out, n_in, dtype=dtype), scheme, g or 64, compute_dtype=dtype)
            for _ in range(n)]
    stored = sum(m.borrowed_nbytes + m.nbytes for m in mods) / n  # bytes one pass reads
    x = torch.randn(1, n_in, dtype=dtype)
    with torch.inference_mode():
        for m in mods:  # first touch (and kernel set-up) outside the timing
            m(x)
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            mods[calls % n](x)
            calls += 1
        dt = time.perf_counter() - t0
    return calls * stored / dt


def current_machine() -> Machine:
    """Memory and VRAM now; no speed is probed (they change the predicted speed, not the plan)."""
    mi = meminfo()
    vram = None
    try:
        import torch

        if torch.cuda.is_available():
            vram = torch.cuda.mem_get_info()[0]
    except Exception:  # a broken CUDA install plans as CPU-only
        vram = None
    avail, capped = mem_available()
    return Machine(avail, mi.get("MemFree", 0), vram, 1e9, RAM_BPS, "not measured", cgroup=capped)


def probe_machine(path: str, seconds: float = 0.5, chunk: int = 4 * MiB, scheme: str | None = None,
                  disk_bps: float | None = None) -> Machine:
    """Memory and VRAM now, the read speed of `path`'s device (or `disk_bps` as given), and, with
    `scheme`, the matrix-vector speed and the per-op cost of torch on this machine."""
    import torch

    m = current_machine()
    if disk_bps is not None:
        m.disk_bps, m.disk_note = disk_bps, "--disk-speed"
    elif seconds > 0:
        m.disk_bps, m.disk_note = measure_disk(path, seconds, chunk)
    if scheme is not None and seconds > 0:
        m.ram_bps = measure_matvec(scheme, min(seconds, 0.3))
        m.op_s = measure_op()
        n = torch.get_num_threads()
        m.ram_note = f"measured, {scheme} matrix-vector, {n} thread{'s' if n != 1 else ''}"
    return m
