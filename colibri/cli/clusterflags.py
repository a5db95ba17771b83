"""The cluster flags (colibri/cluster, docs/CLUSTER.md), shared by the engine commands and `colibri plan`."""

from __future__ import annotations

import argparse


def add_cluster_args(p: argparse.ArgumentParser, positive, number) -> None:
    """--cluster ADDRESS, --cluster-stages N, --cluster-timeout S (`positive`/`number`: cli/common.py's checks)."""
    g = p.add_argument_group("cluster (Ray; pip install 'colibri[cluster]')")
    g.add_argument("--cluster", metavar="ADDRESS", default=None,
                   help="run the layers as pipeline stages on the Ray cluster at HOST:PORT (auto: the one this "
                        "machine's `ray start` joined): one stage per node offering the resource 'colibri', layers "
                        "split in proportion to the nodes' budgets (--mem-budget applies per node)")
    g.add_argument("--cluster-mode", choices=("pipeline", "experts"), default="pipeline",
                   help="pipeline: each node holds a range of layers (default); experts: this machine keeps attention, "
                        "the dense layers and the K/V, the nodes hold shares of every layer's routed experts")
    g.add_argument("--cluster-stages", type=positive("--cluster-stages"), default=None, metavar="N",
                   help="use N of the nodes offering 'colibri' (default: all of them)")
    g.add_argument("--cluster-timeout", type=number("--cluster-timeout", 0, lo_open=True), default=None, metavar="S",
                   help="seconds a step may wait for the stages before it fails (default 300)")


def check_cluster_args(a: argparse.Namespace, error) -> None:
    """Flags that do not apply to a cluster's head: one line (`error`: ColibriError)."""
    if getattr(a, "cluster", None) is None:
        return
    for flag, v in (("--gpu-layers", a.gpu_layers), ("--ram-layers", a.ram_layers), ("--disk-layers", a.disk_layers),
                    ("--usage-file", a.usage_file), ("--route-trace", a.route_trace)):
        if v is not None:
            raise error(f"{flag} does not apply with --cluster: each stage places its own layers under its budget")
