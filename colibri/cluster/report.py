"""`colibri plan --cluster ADDRESS`: which node would hold which layers, what each would keep in RAM, and the speed
to expect. It starts a stage actor on each node for its facts (the container's checksum, the node's budget and
memory), as `--cluster` does, and stops them; nothing is loaded."""

from __future__ import annotations

import statistics
import time

from ..store.sizes import ModelSizes, human
from . import nodes
from .split import layer_bytes, split, stage_placement

PINGS = 8  # round trips timed per remote stage


def hop_seconds(actors: list, names: list[str], idle_s: float) -> float | None:
    """Half the median round trip of a call to each remote stage, each after `idle_s` of idle time: a pipeline
    calls a stage once a step, and a call after a step's idle pays the wake-ups of Ray's threads on both sides
    (2-3x a back-to-back call on the test VM: docs/BENCHMARKS.md "On a Ray cluster"). None without a remote stage."""
    trips = []
    for a, name in zip(actors, names):
        if isinstance(a, nodes.LocalActor):
            continue
        for _ in range(PINGS):
            time.sleep(idle_s)
            t0 = time.perf_counter()
            nodes.wait([a.ping.remote()], [name], nodes.PING_S)
            trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2 if trips else None


def cluster_report(container, sizes: ModelSizes, address: str, n_stages: int | None, mem_budget: int | None,
                   single_s: float) -> str:
    """`single_s`: the planner's seconds per token with every weight in RAM on one such node."""
    picked, actors, facts, budgets = nodes.start_all(address, n_stages, container, mem_budget)
    try:
        hop_s = hop_seconds(actors, [f["name"] for f in facts], min(single_s, 0.05))
    finally:
        nodes.kill(actors)  # (their facts and round trips were all this needed)
    me = nodes.ray().get_runtime_context().get_node_id()
    ranges = split(layer_bytes(sizes), budgets)
    lines = [f"cluster: {len(picked)} stage(s) on {address}; layers split in proportion to the nodes' budgets"]
    streamed = False
    for j, (f, n, (lo, hi), b) in enumerate(zip(facts, picked, ranges, budgets)):
        held = sum(layer_bytes(sizes)[lo:hi])
        tiers = stage_placement(sizes, lo, hi, b).tiers[lo:hi]
        disk = tiers.count("disk")
        streamed |= disk > 0
        where = "all in RAM" if not disk else f"{disk} layer(s)' experts streamed from disk"
        lines.append(f"  stage {j}: {f['name']}{' (this process)' if n['NodeID'] == me else ''}: layers {lo}-{hi - 1}, "
                     f"{human(held)} of weights, budget {human(b)}"
                     f"{'' if f['budget'] is not None else ' (its free memory)'}: {where}")
    remote = sum(n["NodeID"] != me for n in picked)
    hops = remote + (remote > 0)  # (into each remote stage, and back to the head)
    t = single_s + hops * (hop_s or 0.0)
    lines.append(f"expected decode (one stream): ~{1 / t:.1f} tok/s = one node's in-RAM step "
                 f"({single_s * 1000:.1f} ms)"
                 + (f" + {hops} process crossing(s) x {hop_s * 1000:.2f} ms (half a Ray round trip to the stages, "
                    "measured now after a step's idle time; more where the stages share cores)" if hops else "")
                 + ("; slower where a stage streams experts (`colibri plan` on that node shows its disk's share)"
                    if streamed else ""))
    return "\n".join(lines)
