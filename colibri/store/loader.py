"""Loading routed experts into engine-owned buffers: read the record, build (or refresh) its modules.

Used by the tiered store for resident experts and by the expert cache for every miss; `load`
runs on the reader's pool threads.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

import torch

from ..models.moe import ExpertWeights
from .reader import aligned_buffer, round_up
from .sizes import EXTRA_ALIGN
from .weights import expert_weights, qlinear_from

if TYPE_CHECKING:
    from .tiered import TieredStore

class RecordLoader:
    """Reads expert records into a given buffer (CPU, or a device through a staging buffer) and
    builds their QLinears there. `load` runs on the reader's pool threads."""

    def __init__(self, store: TieredStore, prefixes: dict[int, str]):
        self.c, self.reader, self.dtype = store.c, store.reader, store.compute_dtype
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
            self._infos[layer] = infos = store.record_infos(f"{prefix}.0")
            members = self.c.record(f"{prefix}.0")["members"]
            self._layout[layer] = tuple(sorted(
                (sub, m["rel_offset"], m["dtype"], tuple(m["shape"]), repr(infos[sub].get("quant")))
                for sub, m in members.items()))
        self.max_nbytes = max((nb for _, _, nb in self._where.values()), default=0)
        self.rec_span = round_up(self.max_nbytes)  # a cache slot's module buffers start here
        self.builds = 0  # modules built (the rest of the loads refreshed a slot's modules in place)

    def nbytes(self, layer: int, expert: int) -> int:
        return self._where[layer, expert][2]

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
        views = self.c.record_views(name, buf)
        # A refilled slot with the same record layout keeps its modules: their weight views
        # already see the new bytes, so only what a module derived from them is recomputed.
        # Building modules costs about as much as computing the expert once, under the GIL.
        key = buf.data_ptr()
        prev = self._built.get(key)
        if prev is not None and prev[0] == self._layout[layer] and _refresh(prev[1], views, self._infos[layer],
                                                                             self.dtype):
            return prev[1]
        w = expert_weights(views, self._infos[layer], self.dtype, buf.device)
        self.builds += 1
        if buf.numel() > self.rec_span:  # a cache slot: its tail holds the modules' own buffers
            adopt(w, buf[self.rec_span :])
        self._built[key] = (self._layout[layer], w)
        return w


def adopt(w: ExpertWeights, tail: torch.Tensor) -> None:
    """Move the buffers the modules allocated (casts, int4 repack) into `tail`, the slot's own
    memory: nothing of a cached expert then lives outside the arena, so refills never grow RSS."""
    pos = 0
    for q in (w.gate_up, w.down):
        for name in sorted(q._owned):
            t = getattr(q, name)
            n = t.numel() * t.element_size()
            if pos + n > tail.numel():
                return  # (cannot happen with slots sized by slot_bytes)
            dst = tail[pos : pos + n].view(t.dtype).view(t.shape)
            dst.copy_(t)
            q._buffers[name] = dst
            pos = round_up(pos + n, EXTRA_ALIGN)


def _refresh(w: ExpertWeights, views: dict[str, torch.Tensor], infos: dict[str, dict], dtype: torch.dtype) -> bool:
    """Bring an expert's modules up to date after new bytes landed under their weight views.

    Casts (int8 scale, bias, float weight) are redone in place (copy_ rounds like .to()); any
    other derived buffer (the int4 repack) is rebuilt by a throwaway QLinear and copied into
    the module's own buffers, so the repack recipe stays quant.py's alone. False when shapes
    disagree (the caller then builds new modules). tests/test_tiers.py checks the bits.
    """
    casts = {"scale", "bias", "weight"}
    for part in ("gate_up", "down"):
        q = getattr(w, part)
        wname = f"{part}.weight"
        if q._owned <= casts and ("scale" not in q._owned or q.scheme == "int8"):
            src = {"scale": wname + ".scale", "bias": f"{part}.bias", "weight": wname}
            for name in q._owned:
                getattr(q, name).copy_(views[src[name]])
            continue
        bias = views.get(f"{part}.bias")
        tmp = qlinear_from({sfx: views[wname + sfx] for sfx in ("", ".scale", ".min") if wname + sfx in views},
                           infos[wname], bias, dtype)
        if tmp._owned != q._owned or any(getattr(tmp, n).shape != getattr(q, n).shape for n in q._owned):
            return False
        for name in q._owned:
            getattr(q, name).copy_(getattr(tmp, name))
    return True


def release_free_heap() -> None:
    """Hand the heap memory freed while loading back to the OS. Building modules frees large
    temporaries (the int4 repack's), and glibc keeps freed heap pages mapped: for an int4 model
    without a budget that was ~0.9x the weights of extra RSS. No-op off glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
