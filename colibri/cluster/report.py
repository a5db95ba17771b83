"""`colibri plan --cluster ADDRESS`: which node would hold which layers, what each would keep in RAM, and the speed
to expect. It starts a stage actor on each node for its facts (the container's checksum, the node's budget and
memory), as `--cluster` does, and stops them; nothing is loaded."""

from __future__ import annotations

from ..store.sizes import ModelSizes, human
from . import nodes
from .split import layer_bytes, split, stage_placement

# What a token pays per process crossed, measured with benchmarks/bench_cluster.py on a 2-core VM (a bare Ray actor
# call and back ~1.1 ms; with a stage's own work around it ~2 ms a hop): an estimate, not a promise.
HOP_S = 0.002


def cluster_report(container, sizes: ModelSizes, address: str, n_stages: int | None, mem_budget: int | None,
                   single_s: float) -> str:
    """`single_s`: the planner's seconds per token with every weight in RAM on one such node."""
    picked, actors, facts, budgets = nodes.start_all(address, n_stages, container, mem_budget)
    nodes.kill(actors)  # (their facts were all this needed)
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
    hops = len(picked) - (picked[0]["NodeID"] == me) + 1 if len(picked) > 1 else 0
    t = single_s + hops * HOP_S
    lines.append(f"expected decode (one stream): ~{1 / t:.1f} tok/s = one node's in-RAM step "
                 f"({single_s * 1000:.1f} ms) + {hops} process crossing(s) x ~{HOP_S * 1000:.0f} ms"
                 + ("; slower where a stage streams experts (`colibri plan` on that node shows its disk's share)"
                    if streamed else ""))
    return "\n".join(lines)
