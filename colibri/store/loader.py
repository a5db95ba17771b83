"""Loading routed experts into engine-owned buffers: read the record, build (or refresh) its modules.

Used by the tiered store for resident experts and by the expert cache for every miss; `load`
runs on the reader's pool threads.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ..arena import aligned_buffer
from ..format.container import Container
from ..layers.moe import ExpertWeights
from .reader import RecordReader, round_up
from .weights import expert_weights


class RecordLoader:
    """Reads expert records into a given buffer (CPU, or a device through a staging buffer) and
    builds their QLinears there. `load` runs on the reader's pool threads."""

    def __init__(self, container: Container, reader: RecordReader, compute_dtype: torch.dtype,
                 prefixes: dict[int, str]):
        self.c, self.reader, self.dtype = container, reader, compute_dtype
        self.prefixes = prefixes
        self._where: dict[tuple[int, int], tuple[str, int, int]] = {}
        self._infos: dict[int, dict[str, dict]] = {}
        self._layout: dict[int, tuple] = {}
        self._built: dict[int, tuple[tuple, ExpertWeights]] = {}  # buffer address -> (layout, modules)
        self._local = threading.local()
        for layer, prefix in prefixes.items():
            e = 0
            while self.c.has_record(name := f"{prefix}.{e}"):
                r = self.c.header["records"][name]
                self._where[layer, e] = (name, r["offset"], r["nbytes"])
                e += 1
            # Every expert of a layer has the same members, schemes and shapes.
            first = self.c.record(f"{prefix}.0")
            self._infos[layer] = infos = {sub: self.c.info(full) for sub, full in first["tensors"].items()}
            members = first["members"]
            self._layout[layer] = tuple(sorted(
                (sub, m["rel_offset"], m["dtype"], tuple(m["shape"]), repr(infos[sub].get("quant")))
                for sub, m in members.items()))
        self.max_nbytes = max((nb for _, _, nb in self._where.values()), default=0)
        self.rec_span = round_up(self.max_nbytes)  # a cache slot's module buffers start here
        self.builds = 0  # modules built (the rest of the loads refreshed a slot's modules in place)

    def nbytes(self, layer: int, expert: int) -> int:
        return self._where[layer, expert][2]

    def quant(self, layer: int) -> tuple[str, int] | None:
        """The scheme and group size of `layer`'s expert projections (None: float weights)."""
        q = self._infos[layer].get("gate_up.weight", {}).get("quant")
        return None if q is None else (q["scheme"], q["group_size"])

    def _staging(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(round_up(self.max_nbytes))
        return buf

    def load(self, layer: int, expert: int, buf: torch.Tensor) -> ExpertWeights:
        name, off, nb = self._where[layer, expert]
        if buf.device.type == "cpu":
            self.reader.read_into(buf, off, nb)
        else:
            st = self._staging()
            self.reader.read_into(st, off, nb)
            buf[:nb].copy_(st[:nb])
        # A refilled slot with the same record layout keeps its modules: their weight views
        # already see the new bytes, so only what a module derived from them is recomputed
        # (nothing, for int8 kernels' modules). Building modules costs about as much as computing
        # the expert once, under the GIL.
        key = buf.data_ptr()
        prev = self._built.get(key)
        if prev is not None and prev[0] == self._layout[layer] and _nothing_derived(prev[1]):
            return prev[1]
        views = self.c.record_views(name, buf)
        if prev is not None and prev[0] == self._layout[layer] and _refresh(prev[1], views):
            return prev[1]
        w = expert_weights(views, self._infos[layer], self.dtype, buf.device)
        self.builds += 1
        if buf.numel() > self.rec_span:  # a cache slot: its tail holds the modules' own buffers
            adopt(w, buf[self.rec_span :])
        self._built[key] = (self._layout[layer], w)
        return w


def adopt(w: ExpertWeights, tail: torch.Tensor) -> None:
    """Move the buffers the expert's modules allocated into `tail`, the slot's own memory
    (QLinear.move_owned): nothing of a cached expert then lives outside the arena."""
    pos = 0
    for q in (w.gate_up, w.down):
        pos = q.move_owned(tail, pos)


def _nothing_derived(w: ExpertWeights) -> bool:
    """Whether the expert's modules compute from their weight views alone (QLinear's `_owned`: nothing cast or
    repacked), so that new bytes under the views need no refresh."""
    return all(getattr(m, "_owned", None) == set() for m in (w.gate_up, w.down))


def _refresh(w: ExpertWeights, views: dict[str, torch.Tensor]) -> bool:
    """Bring an expert's modules up to date after new bytes landed under their weight views
    (QLinear.refill); False when a module cannot be refilled (the caller then builds new ones)."""
    for part in ("gate_up", "down"):
        wname = f"{part}.weight"
        tensors = {sfx: views[wname + sfx] for sfx in ("", ".scale", ".min") if wname + sfx in views}
        if not getattr(w, part).refill(tensors, views.get(f"{part}.bias")):
            return False
    return True


def release_free_heap() -> None:
    """Hand the heap memory freed while loading back to the OS. Building modules frees large
    temporaries (the int4 repack's), and glibc keeps freed heap pages mapped: for an int4 model
    without a budget that was ~0.9x the weights of extra RSS. No-op off glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
