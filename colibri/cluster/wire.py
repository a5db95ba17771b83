"""What crosses between the head and the stages: numpy arrays, not torch tensors.

Ray serializes numpy arrays out of band (pickle 5 buffers) and torch tensors through torch's own reducer: a
chain of two stage calls with a 2 KiB row and the routes took 7.5 ms with tensors and 2.3 ms with arrays here
(benchmarks/bench_cluster.py). bf16 has no numpy dtype: its bits travel as int16. A step's routes travel as two
stacks (every layer's ids, every layer's weights), not two small arrays a layer: each array is a buffer of its own
for Ray, and a row with 16 of them took 1.55 ms there and back against 1.30 ms with one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..engine.stats import StackedRoutes

# MoE layers, and their ids [L, T, k] int64 and weights [L, T, k] f32: one stack each, whatever the layer count
Packed = tuple[tuple[int, ...], np.ndarray, np.ndarray]


def pack(t: torch.Tensor) -> np.ndarray:
    """A tensor's bits as a numpy array (bf16 as int16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def unpack(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`pack`'s inverse, into memory the caller may overwrite (what Ray hands over is read-only)."""
    t = torch.from_numpy(np.array(a))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def pack_routes(routes: Mapping, before: Packed | None = None) -> Packed | None:
    """A step's routes (MoE layer -> (ids [T, k], weights [T, k])) stacked after those `before` them (the stages
    earlier in the pipeline); None where there are none. Weights cross as f32 (bf16 widens exactly). The layers
    stack as the native step's routes do: every MoE layer of a model routes a row to the same number of experts."""
    if isinstance(routes, StackedRoutes):
        layers, ids, w = tuple(routes.layers), routes.idx.numpy(), routes.wts.float().numpy()
    elif routes:
        layers = tuple(routes)
        ids = np.stack([i.numpy() for i, _ in routes.values()])
        w = np.stack([x.float().numpy() for _, x in routes.values()])
    else:
        return before
    ids = ids.astype(np.int64, copy=False)
    if before is None:
        return layers, ids, w
    return before[0] + layers, np.concatenate([before[1], ids]), np.concatenate([before[2], w])


def unpack_routes(packed: Packed | None) -> Mapping:
    """`pack_routes`' inverse, read as the plan's routes are (engine/stats.py StackedRoutes)."""
    if packed is None:
        return {}
    layers, ids, w = packed
    return StackedRoutes(list(layers), torch.from_numpy(np.array(ids)), torch.from_numpy(np.array(w)))
