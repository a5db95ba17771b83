"""KV slots: N sequences' caches, preallocated once for `ctx` positions each, and what each holds.

A slot is one sequence's list of per-layer caches (K/V for attention layers, the latent for
MLA). Slots are handed to requests and taken back when they end; nothing is allocated per
request, so memory is `n_slots x ctx x bytes_per_position` for the engine's whole life.

A slot also remembers the tokens whose K/V it holds (positions 0..len-1). A new request takes
the free slot whose tokens share the longest prefix with its prompt and skips computing that
prefix (prompt caching, llama-server's `cache_prompt`): a chat's next turn re-sends the whole
conversation, and only the new part is prefilled. Where another slot, busy or free, holds a
longer prefix (a system prompt shared by several conversations), its K/V are copied over: a copy
of what was computed, the same bits, for a fraction of the compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import arena
from ..layers.kvquant import DEFAULT, KVTypes


def positions(cache, start: int, end: int) -> dict[str, torch.Tensor]:
    """Views of positions start..end of a layer cache's tensors (KVCache, LatentCache: `parts()`)."""
    return {k: t.narrow(cache.POS_DIM, start, end - start) for k, t in cache.parts().items()}


def rewinds(cache) -> bool:
    """Whether rows written past a sequence's length can be dropped by bookkeeping alone (a speculative verify's
    rejected drafts: engine/speculative.py): a cache indexed by position (`parts()`; a sparse attention's indexer
    keys included)."""
    return bool(cache.parts())


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. Blocks of 256 compare as slices (in C), so a 32k-token
    conversation costs ~130 Python steps per slot, not 32k (admission holds the scheduler's lock)."""
    n = min(len(a), len(b))
    i = 0
    while i + 256 <= n and a[i:i + 256] == b[i:i + 256]:
        i += 256
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    def __init__(self, model: nn.Module, n_slots: int, ctx: int, dtype: torch.dtype,
                 device_of: Callable[[int], torch.device], types: KVTypes = DEFAULT):
        self.n_slots, self.ctx, self.types = n_slots, ctx, types
        self.caches: list[list] = []
        # One arena a slot (huge pages where the slot's caches reach a few MiB, colibri/arena.py): what its
        # caches hold on the meta device, plus a page a tensor for their alignment.
        meta = model.make_cache(ctx, dtype, "meta", types)
        slot_bytes = sum(c.nbytes for c in meta) + 4 * arena.PAGE * len(meta)
        for _ in range(n_slots):
            with arena.pooled(slot_bytes):
                caches = model.make_cache(ctx, dtype, types=types)
            for i, cache in enumerate(caches):
                if device_of(i).type != "cpu":
                    cache.to(device_of(i))
            self.caches.append(caches)
        # Whether every layer's contents are indexed by position, so that a prefix of them can be kept (a
        # linear-attention, short-convolution or Mamba layer's state is the whole past: no prompt caching, nothing
        # to save; a layer another cluster stage holds does not count here)
        self.rewindable = all(c.parts() for c in self.caches[0] if not getattr(c, "elsewhere", False)) \
            if self.caches else True
        self._free = list(range(n_slots))  # least recently released first
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]  # per slot: the ids its K/V hold
        self.copied = 0  # positions copied between slots (a shared prefix)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for caches in self.caches for c in caches)

    @property
    def bytes_per_position(self) -> int:
        return sum(c.nbytes for c in self.caches[0]) // self.ctx if self.caches else 0

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self, prompt: list[int] | None = None) -> tuple[int, int] | None:
        """A free slot and how many leading tokens of `prompt` its cache holds: the free slot with the
        longest shared prefix, else the least recently used one (whose contents are the least likely
        to be asked for again); topped up from any slot that holds more of the prompt. None when
        every slot is taken. Only the engine thread calls it (between steps: the copy is safe)."""
        if not self._free:
            return None
        best, shared = self._free[0], 0
        if prompt:
            held = [common_prefix(t, prompt) for t in self.tokens]
            best = max(self._free, key=lambda s: held[s])  # (ties: the least recently used)
            src = max(range(self.n_slots), key=lambda s: held[s])
            shared = held[best]
            if held[src] > shared:
                self._copy(src, best, shared, held[src])
                shared = held[src]
        self._free.remove(best)
        return best, shared

    def _copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Positions start..end of slot src's caches (and tokens) into slot dst."""
        for a, b in zip(self.caches[dst], self.caches[src]):
            into = positions(a, start, end)
            for name, t in positions(b, start, end).items():
                into[name].copy_(t)
        self.tokens[dst][start:] = self.tokens[src][start:end]
        self.copied += end - start

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def release(self, slot: int) -> None:
        # No clearing: a sequence only reads positions it wrote (attention stops at its own length).
        self._free.append(slot)

    def wrote(self, slot: int, start: int, tokens: list[int]) -> None:
        """A step wrote the K/V of `tokens` at positions start.. of the slot."""
        held = self.tokens[slot]
        del held[start:]
        if len(held) == start:
            held.extend(tokens)

    def forget(self, slot: int, start: int = 0) -> None:
        """The slot's positions from `start` on are no longer known (a failed step, an outside writer)."""
        del self.tokens[slot][start:]
