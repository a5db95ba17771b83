"""Streamed layers inside the one-call step: the engine's side of the kernels' layer hook (kernels/step.c
moe_streamed).

coli_decode_layers calls back at each routed layer given a hook, once its rows are routed (HOOK_ROUTED, with
the routes and the layer's residual): a layer whose experts a cache serves claims them and starts reading those
not in memory (the cache's own `fetch`, in layer order, so hits, recency, the reuse clock and the prefetch
scores see the step as the per-layer path would); then the look-ahead (store/lookahead.py) predicts the next
routed layer's experts from the residual and starts their reads, so they run during this layer's compute. While
the layer lacks a routed expert, the kernel computes those it has and asks for the next read to land
(HOOK_WAIT), in the order they land. A step with misses so stays in its one call: no attention computed twice,
no layer run the per-layer way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import torch

from ..kernels import native


class LayerHook:
    """The hook of one NativeLayers' routed layers (`fn`, set in their MoeLayer structs). `tables`: per layer
    an expert cache serves, the native tables the cache keeps equal to the experts in memory. A call runs
    through `run`."""

    def __init__(self, source, tables: dict[int, native.MoeTables], k: int, hidden: int):
        self.source, self.tables, self.k, self.hidden = source, tables, k, hidden
        self.fn = native.LAYER_HOOK(self._call)  # (kept alive here: the structs hold only its address)
        self.fetching: Iterator | None = None  # a layer's fetch: the experts not in memory at its start, as they land
        self.error: BaseException | None = None

    def run(self, call, *args, **kw):
        """call(*args, **kw): a native call through the hooked layers; what a callback raised is raised here
        (the kernel only returns a code), and the last layer's claims are released."""
        self.error = None
        try:
            return call(*args, **kw)
        except native.HookFailed as e:
            raise (self.error or e) from None
        finally:
            self._close()
            self.error = None

    def _call(self, layer: int, event: int, idx, n: int, h: int | None, pred, n_pred: int) -> int:
        try:
            return self._routed(layer, idx, n, h, pred, n_pred) if event == native.HOOK_ROUTED else self._wait()
        except BaseException as e:  # noqa: BLE001 - a callback cannot raise through C: run() raises it
            self.error = e
            return -1

    def _routed(self, layer: int, idx, n: int, h: int | None, pred, n_pred: int) -> int:
        self._close()
        T = n // self.k
        tables = self.tables.get(layer)
        if tables is not None:
            routes = idx[:n]  # (a ctypes pointer's slice: a list of ints)
            # (the ids SwitchGLU would fetch: one row's in its own order, a batch's union sorted)
            ids = list(dict.fromkeys(routes)) if T == 1 else sorted(set(routes))
            self.source.collect_landed([layer])  # (prefetches that landed: into the table first)
            # (loaded=False: the experts in memory now the kernel computes from the table before it asks for more)
            self.fetching = self.source.fetch(layer, ids, loaded=False)
        ahead = self.source.ahead
        if ahead is None or layer not in ahead.next:
            return 0
        if n_pred and T == 1:  # (the kernel applied the next layer's norm and router)
            ahead.read_row(layer, pred[:n_pred])
        elif n_pred:
            ahead.read(layer, np.array(pred[:n_pred], dtype=np.int64).reshape(T, -1))
        elif h:
            resid = torch.frombuffer((ctypes.c_uint16 * (T * self.hidden)).from_address(h), dtype=torch.bfloat16)
            ahead(layer, resid.view(T, self.hidden))
        return 0

    def _wait(self) -> int:
        """Until another of the layer's experts is in its table: 1, or 0 when none is left to come."""
        if self.fetching is None:
            return 0
        for _ in self.fetching:  # (each one claimed until the next is asked for: the kernel computes it first)
            return 1
        self.fetching = None
        return 0

    def _close(self) -> None:
        if self.fetching is not None:
            self.fetching.close()
            self.fetching = None
