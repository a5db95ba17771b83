"""Pipeline stages on a local Ray cluster (colibri/cluster) against the single-node engine, in the same run.

    .venv/bin/python benchmarks/bench_cluster.py --part ram      # (a) the 0.44B OLMoE shape in RAM
    .venv/bin/python benchmarks/bench_cluster.py --part capped   # (b) a model ~1.5x one node's memory cap

Every node is a `ray start` process group on this machine (its own raylet and stage worker), stopped at the end.
(a) single node vs 1, 2 and 3 stages (stage 0 in the head's process), 1 and 8 streams: tok/s, the ms a token
gains per hop (a hop: one process crossing, S of them for S stages: stage 0 -> 1 -> ... -> the head; 1 stage has
none and measures the head's own cost), bytes crossing processes per token, the pipeline's bubble. The single node runs
with as many threads as one stage (`--threads`), so the difference is the pipeline's, not the cores'.
(netem) 2 stages with stage 1 in its own network namespace, 0 and 0.5 ms of delay each way: over a veth pair with
`tc netem`, and over two taps joined by benchmarks/delayline.py (a userspace delay line, where the kernel has no
sch_netem; its 0 ms row is its own cost).
(b) one node streaming the model under `memcap CAP` (its experts beyond `--mem-budget` read from disk, from a cold
page cache) vs 2 nodes, each `ray start` under `memcap CAP` with the same --mem-budget, holding half the layers in
RAM; the head process runs under the same cap. Peak memory per node from memcap's cgroup peak.
Load average printed with every row; nothing else should run meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT.parent / "shared" / "tools"
RAY = str(Path(sys.executable).parent / "ray")
PROMPTS = ["The history of the city begins", "In a small village by the sea", "The theory of relativity says",
           "Once upon a time there was", "The best way to cook rice is", "Machine learning models can",
           "The river flows through the valley", "A good night's sleep helps"]


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] >= 20000:  # above Ray's worker ports
                return s.getsockname()[1]


class LocalCluster:
    """A head node and n - 1 more, each offering one stage with `cpus` CPUs, optionally each under memcap. The
    head's stage runs in the engine's own process (colibri/cluster/nodes.py LocalActor), as on a real cluster
    whose head machine also holds layers."""

    def __init__(self, n: int, cpus: int, cap: str | None = None, budget: str | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
        if budget:
            self.env["COLIBRI_STAGE_BUDGET"] = budget
        self.blocked: list[subprocess.Popen] = []
        self.logs = []
        node = ["--node-ip-address", "127.0.0.1"]
        stage = ["--num-cpus", str(cpus), "--resources", '{"colibri": 1}']
        self._start(["--head", "--port", str(self.port), "--include-dashboard", "false", *stage, *node], cap)
        for _ in range(n - 1):
            self._start(["--address", self.address, *stage, *node], cap)
        time.sleep(2)

    def _start(self, args: list[str], cap: str | None) -> None:
        if cap is None:
            subprocess.run([RAY, "start", *args], check=True, capture_output=True, env=self.env, timeout=120)
            return
        log = open(f"/tmp/colibri-bench-cluster-{len(self.blocked)}.log", "w")  # memcap prints the peak at exit
        self.logs.append(log.name)
        self.blocked.append(subprocess.Popen([str(TOOLS / "memcap"), cap, RAY, "start", "--block", *args],
                                             stdout=log, stderr=subprocess.STDOUT, env=self.env))
        time.sleep(4)

    def stop(self) -> list[int]:
        """Stop every node; the memcap peaks (MiB) of the capped ones."""
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=self.env, timeout=120)
        peaks = []
        for p, log in zip(self.blocked, self.logs):
            p.wait(60)
            m = re.search(r"memcap: limit \S+, peak (\d+) MiB", Path(log).read_text())
            peaks.append(int(m[1]) if m else -1)
        return peaks


def child(a: argparse.Namespace) -> None:
    """One engine (single node or the head of a cluster): warm up, then 1 and 8 streams; JSON on stdout."""
    import colibri
    from colibri.api import peak_rss_mib

    if a.start_head:  # (b): the head node's Ray processes in this process's cgroup, then wait for the others
        port = a.address.rpartition(":")[2]
        subprocess.run([RAY, "start", "--head", "--port", port, "--include-dashboard", "false", "--node-ip-address",
                        "127.0.0.1", "--num-cpus", str(a.threads), "--resources", '{"colibri": 1}'], check=True,
                       capture_output=True, timeout=120)
        import ray

        ray.init(address=a.address, log_to_driver=False)
        while sum(n["Alive"] and n["Resources"].get("colibri", 0) > 0 for n in ray.nodes()) < a.stages:
            time.sleep(0.5)
    kw = dict(cluster=a.address, cluster_stages=a.stages, cluster_mode=a.mode) if a.address else {}
    llm = colibri.load(a.model, ctx_size=256, threads=a.threads, slots=max(a.streams), cache_prompt=False,
                       mem_budget=a.engine_budget, **kw)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    out = []
    for n in a.streams:
        for h in [llm.submit(ids[i], 16, ignore_eos=True) for i in range(n)]:  # warm-up: every path
            h.wait()
        m0, t0 = llm.metrics(), time.perf_counter()
        hs = [llm.submit(ids[i], a.tokens, ignore_eos=True) for i in range(n)]
        toks = [h.wait() for h in hs]
        wall = time.perf_counter() - t0
        m1 = llm.metrics()
        gen = sum(len(t) for t in toks)
        c0, c1 = m0.get("cluster", {}), m1.get("cluster", {})
        row = {"streams": n, "tok_s": gen / wall, "ms_per_step": 1000 * wall / max(m1["steps"] - m0["steps"], 1),
               "tokens": toks, "read_per_token": (m1["store"]["bytes_read"] - m0["store"]["bytes_read"]) / gen,
               "load": os.getloadavg()[0]}
        if c1 and a.mode == "experts":
            row.update(moved_per_token=(c1["bytes_moved"] - c0["bytes_moved"]) / gen)
        elif c1:
            st = llm.plan.stage_stats()
            steps = c1["steps"] - c0["steps"]
            row.update(moved_per_token=(c1["bytes_moved"] - c0["bytes_moved"]) / gen,
                       bubble=(c1["bubble"] * c1["steps"] - c0["bubble"] * c0["steps"]) / max(steps, 1),
                       read_per_token=sum(s["store"].get("bytes_read", 0) for s in st) / gen,
                       stage_rss_mib=[s["peak_rss"] / 2**20 for s in st], layers=c1["layers"])
        out.append(row)
    remote = [s for s in llm.plan.stages if s.index > 0] if a.address and a.mode == "pipeline" else []
    if remote:  # the transport's floor: an actor call with a decode row and its routes, and back
        import numpy as np
        import ray
        import torch

        from colibri.cluster import wire

        x = (np.zeros((1, llm.model.model.embed_tokens.dim), np.int16), wire.pack_routes(
            {i: (torch.zeros(1, 8, dtype=torch.int64), torch.zeros(1, 8)) for i in range(llm.n_layers)}))
        for _ in range(50):
            ray.get(remote[0].actor.echo.remote(x))
        t0 = time.perf_counter()
        for _ in range(500):
            ray.get(remote[0].actor.echo.remote(x))
        hot = (time.perf_counter() - t0) * 2
        # and as a pipeline calls it: after a step's worth of idle time (Ray's threads on both sides asleep)
        gap, took, calls = max(out[0]["ms_per_step"] - hot, 0.0) / 1000, 0.0, 200
        for _ in range(calls):
            time.sleep(gap)
            t0 = time.perf_counter()
            ray.get(remote[0].actor.echo.remote(x))
            took += time.perf_counter() - t0
        out.append({"round_trip_ms": hot, "round_trip_gap_ms": took / calls * 1000, "gap_ms": gap * 1000})
    out.append({"head_rss_mib": peak_rss_mib()})
    llm.close()
    print(json.dumps(out))


def run_child(model: Path, threads: int, streams: str, tokens: int, *, address: str | None = None, stages: int = 0,
              cap: str | None = None, budget: str | None = None, start_head: bool = False, others=None,
              mode: str = "pipeline"):
    """The child's rows and its cgroup's peak (MiB); `others(cluster_address)` starts the other nodes once the child
    runs (`start_head`: the child starts the head node, in its own cgroup)."""
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--threads", str(threads), "--streams", streams,
           "--tokens", str(tokens)]
    if address:
        cmd += ["--address", address, "--stages", str(stages), "--mode", mode]
        cmd += ["--start-head"] if start_head else []
    if budget:
        cmd += ["--engine-budget", budget]
    if cap:
        subprocess.run([str(TOOLS / "evict"), str(model)], check=True)
        cmd = [str(TOOLS / "memcap"), cap, *cmd]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               **({"COLIBRI_STAGE_BUDGET": budget} if budget else {}))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    if others is not None:
        others(address)
    out, err = p.communicate()
    if p.returncode != 0:
        sys.exit(f"run failed ({p.returncode}): {err[-3000:]}")
    peak = re.search(r"memcap: limit \S+, peak (\d+) MiB", err)
    return json.loads(out.strip().splitlines()[-1]), int(peak[1]) if peak else None


def head(delay: bool = False, cgroups: bool = False) -> None:
    """The header of the rows `show` prints (a delay column after the engine's for --part netem, cgroup peaks
    before the load for --part capped)."""
    cols = ["engine", *(["delay each way"] if delay else []), "streams", "tok/s", "ms/step", "vs single",
            "ms added/hop", "moved/token", "bubble", "tokens", "read/token", "stage peak RSS",
            *(["cgroup peaks (head, nodes)"] if cgroups else []), "load"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if c in ("engine", "tokens") else "---:" for c in cols) + "|")


def show(name: str, rows: list[dict], base: dict[int, dict] | None, hops: int, peaks=None) -> dict[int, dict]:
    by = {r["streams"]: r for r in rows if "streams" in r}
    rt = next((r for r in rows if "round_trip_ms" in r), None)
    if rt is not None:
        print(f"| ({name}: a bare Ray actor call with a decode row and its routes, and back: {rt['round_trip_ms']:.2f} "
              f"ms back to back, {rt['round_trip_gap_ms']:.2f} ms after {rt['gap_ms']:.1f} ms idle as in a step: "
              f"{rt['round_trip_ms'] / 2:.2f} / {rt['round_trip_gap_ms'] / 2:.2f} ms a hop) |")
    for n, r in by.items():
        line = f"| {name} | {n} | {r['tok_s']:.1f} | {r['ms_per_step']:.2f} |"
        if base is None:
            line += " 1.00x | - | - | - | - |"
        else:
            b = base[n]
            same = "same" if r["tokens"] == b["tokens"] else "DIFFERENT"
            added = (r["ms_per_step"] - b["ms_per_step"]) / hops
            line += (f" {r['tok_s'] / b['tok_s']:.2f}x | {added:+.2f} | {r.get('moved_per_token', 0) / 1024:.1f} KiB |"
                     f" {r.get('bubble', 0):.2f} | {same} |")
        line += f" {r['read_per_token'] / 2**20:.1f} MiB |"
        if "stage_rss_mib" in r:
            line += " " + "/".join(f"{x:.0f}" for x in r["stage_rss_mib"]) + " MiB |"
        if peaks:
            line += " " + "/".join(str(p) for p in peaks) + " MiB |"
        print(line + f" {r['load']:.1f} |", flush=True)
    return by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("ram", "capped", "netem"), default="ram")
    ap.add_argument("--delays", default="0,0.5", help="(netem): ms of delay each way")
    ap.add_argument("--links", default=",".join(LINKS), help="(netem): veth (with tc netem), delay line "
                    "(benchmarks/delayline.py: taps and a userspace delay, for kernels without sch_netem)")
    ap.add_argument("--workdir", default="/tmp/colibri-bench")
    ap.add_argument("--model", default=None, help="(a): the 0.44B shape; (b): the 7B shape int8 (bench_capped.py)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="threads of the single node and of each stage")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--cap", default="4700M", help="(b): each node's memcap (the model ~1.5x it)")
    ap.add_argument("--mem-budget", default="3800M", help="(b): each node's weights budget")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stages", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--start-head", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="pipeline", help=argparse.SUPPRESS)
    ap.add_argument("--engine-budget", default=None, help=argparse.SUPPRESS)  # (the child's --mem-budget)
    a = ap.parse_args()
    if a.child:
        a.streams = [int(x) for x in a.streams.split(",")]
        child(a)
        return
    work = Path(a.workdir)
    if a.part == "netem":
        netem(a, Path(a.model or work / "olmoe-0.44b.int8.coli"))
        return
    if a.part == "ram":
        model = Path(a.model or work / "olmoe-0.44b.int8.coli")
        if not model.exists():
            sys.exit(f"{model} missing: run benchmarks/bench_vs_llamacpp.py once (it writes the 0.44b shape)")
        print(f"(a) {model.name} in RAM, {a.tokens} greedy tokens a stream, {a.threads} thread(s) per process; "
              f"load {os.getloadavg()[0]:.1f}\n")
        head()
        rows, _ = run_child(model, a.threads, a.streams, a.tokens)
        base = show("single node", rows, None, 1)
        cl = LocalCluster(3, a.threads)
        try:
            for n in (1, 2, 3):  # 1: the head's own stage, no process crossed (the head's own cost)
                rows, _ = run_child(model, a.threads, a.streams, a.tokens, address=cl.address, stages=n)
                show(f"{n} stage{'s' * (n > 1)}", rows, base, max(n, 1))
            for n in (2, 3):  # expert workers (one in the head's process): "ms added/hop" is per token, all calls
                rows, _ = run_child(model, a.threads, a.streams, a.tokens, address=cl.address, stages=n,
                                    mode="experts")
                show(f"experts, {n} workers", rows, base, 1)
        finally:
            cl.stop()
        return
    model = Path(a.model or work / "olmoe-7b.int8.coli")
    if not model.exists():
        sys.exit(f"{model} missing: run benchmarks/bench_capped.py once (it writes the 7B shape)")
    size = model.stat().st_size
    print(f"(b) {model.name} ({size / 2**30:.2f} GiB) = {size / _bytes(a.cap):.2f}x the cap {a.cap}; --mem-budget "
          f"{a.mem_budget} per node; {a.tokens} greedy tokens a stream, {a.threads} thread(s) per process, cold "
          f"page cache; load {os.getloadavg()[0]:.1f}\n")
    head(cgroups=True)
    rows, peak = run_child(model, a.threads, a.streams, a.tokens, cap=a.cap, budget=a.mem_budget)
    base = show("1 node, streamed", rows, None, 1, [peak])
    rows, _ = run_child(model, a.threads, a.streams, a.tokens)  # the bound: one node with room for the whole model
    show("1 node, in RAM, no cap (the bound)", rows, base, 1)
    # node 0: the engine's process (the head and its stage) and the head node's Ray processes, in one cgroup;
    # node 1: `ray start --block` under memcap
    port, nodes = free_port(), []

    def node1(address: str) -> None:
        while subprocess.run([RAY, "status", "--address", address], capture_output=True).returncode != 0:
            time.sleep(0.5)
        log = open("/tmp/colibri-bench-cluster-1.log", "w")
        nodes.append((log.name, subprocess.Popen(
            [str(TOOLS / "memcap"), a.cap, RAY, "start", "--block", "--address", address, "--node-ip-address",
             "127.0.0.1", "--num-cpus", str(a.threads), "--resources", '{"colibri": 1}'], stdout=log,
            stderr=subprocess.STDOUT, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                                               COLIBRI_STAGE_BUDGET=a.mem_budget))))
    try:
        rows, peak = run_child(model, a.threads, a.streams, a.tokens, address=f"127.0.0.1:{port}", stages=2,
                               cap=a.cap, budget=a.mem_budget, start_head=True, others=node1)
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
    peaks = [peak]
    for log, p in nodes:
        p.wait(60)
        m = re.search(r"memcap: limit \S+, peak (\d+) MiB", Path(log).read_text())
        peaks.append(int(m[1]) if m else -1)
    show("2 stages", rows, base, 2, peaks)


NS, HOST_IP, NS_IP = "colibri-n1", "10.201.0.1", "10.201.0.2"
LINKS = ("veth", "delay line")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def namespace_link(kind: str):
    """Network namespace NS joined to this one at HOST_IP / NS_IP by a veth pair, or by two taps and
    benchmarks/delayline.py between them (where the kernel has no sch_netem); yields a function that sets the
    delay each way in ms (None: `tc netem` refused it, with the reason)."""
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    sh("ip", "netns", "add", NS)
    line = None
    try:
        if kind == "veth":
            sh("ip", "link", "add", "cveth0", "type", "veth", "peer", "name", "cveth1")
            sh("ip", "link", "set", "cveth1", "netns", NS)
        else:
            line = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "delayline.py"), "cveth0", "cveth1",
                                     "--netns", NS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if line.stdout.readline().strip() != "ready":
                sys.exit("delayline.py did not start")
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", "cveth0")
        sh("ip", "link", "set", "cveth0", "up")
        for cmd in (["addr", "add", f"{NS_IP}/24", "dev", "cveth1"], ["link", "set", "cveth1", "up"],
                    ["link", "set", "lo", "up"]):
            sh("ip", "netns", "exec", NS, "ip", *cmd)

        def delay(ms: float) -> str | None:
            if line is not None:
                line.stdin.write(f"{ms}\n")
                line.stdin.flush()
                return None
            refused = None
            for dev, ns in (("cveth0", []), ("cveth1", ["ip", "netns", "exec", NS])):
                subprocess.run([*ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if ms:
                    p = subprocess.run([*ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{ms}ms"],
                                       capture_output=True, text=True)
                    refused = refused or (p.stderr.strip() if p.returncode else None)
            return refused

        yield delay
    finally:
        if line is not None:
            line.stdin.close()
            line.wait(30)
        subprocess.run(["ip", "link", "del", "cveth0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def netem(a: argparse.Namespace, model: Path) -> None:
    """(a) over a network: stage 1 in its own network namespace, joined to this one by a veth pair with `tc netem`
    delay on both ends, or by benchmarks/delayline.py (a crossing pays the delay once each way)."""
    print(f"(netem) {model.name} in RAM, 2 stages, stage 1 in network namespace {NS}; {a.tokens} greedy tokens a "
          f"stream, {a.threads} thread(s) per process; load {os.getloadavg()[0]:.1f}\n")
    head(delay=True)
    rows, _ = run_child(model, a.threads, a.streams, a.tokens)
    base = show("single node | -", rows, None, 1)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    stage = ["--num-cpus", str(a.threads), "--resources", '{"colibri": 1}']
    for kind in a.links.split(","):
        port = free_port()
        with namespace_link(kind) as set_delay:
            try:
                subprocess.run([RAY, "start", "--head", "--port", str(port), "--node-ip-address", HOST_IP,
                                "--include-dashboard", "false", *stage], check=True, capture_output=True, env=env,
                               timeout=120)
                subprocess.run(["ip", "netns", "exec", NS, RAY, "start", "--address", f"{HOST_IP}:{port}",
                                "--node-ip-address", NS_IP, *stage], check=True, capture_output=True, env=env,
                               timeout=120)
                for delay in [float(d) for d in a.delays.split(",")]:
                    if refused := set_delay(delay):  # (a kernel without sch_netem: "Specified qdisc kind is unknown")
                        print(f"| 2 stages | {kind}, {delay} ms | tc netem refused here: {refused} |")
                        continue
                    rows, _ = run_child(model, a.threads, a.streams, a.tokens, address=f"{HOST_IP}:{port}",
                                        stages=2)
                    show(f"2 stages | {kind}, {delay} ms", rows, base, 2)
            finally:
                subprocess.run(["ip", "netns", "exec", NS, RAY, "stop", "--force"], capture_output=True, timeout=120)
                subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env, timeout=120)


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", size.upper())
    return int(float(m[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m[2]])


if __name__ == "__main__":
    main()
