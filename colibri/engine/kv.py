"""KV slots: N sequences' caches, preallocated once for `ctx` positions each.

A slot is one sequence's list of per-layer caches (K/V for attention layers, the latent for
MLA). Slots are handed to requests and taken back when they end; nothing is allocated per
request, so memory is `n_slots x ctx x bytes_per_position` for the engine's whole life.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class SlotPool:
    def __init__(self, model: nn.Module, n_slots: int, ctx: int, dtype: torch.dtype,
                 device_of: Callable[[int], torch.device]):
        self.n_slots, self.ctx = n_slots, ctx
        self.caches: list[list] = []
        for _ in range(n_slots):
            caches = model.make_cache(ctx, dtype)
            for i, cache in enumerate(caches):
                if device_of(i).type != "cpu":
                    cache.to(device_of(i))
            self.caches.append(caches)
        self._free = list(range(n_slots))[::-1]  # popped from the end: slot 0 first

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for caches in self.caches for c in caches)

    @property
    def bytes_per_position(self) -> int:
        return sum(c.nbytes for c in self.caches[0]) // self.ctx if self.caches else 0

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        # No clearing: a sequence only reads positions it wrote (attention stops at its own length).
        self._free.append(slot)
