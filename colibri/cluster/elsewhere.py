"""A model skeleton that holds only part of the model: the layers of one pipeline stage, or only its ends.

The layers another process holds are replaced by `Elsewhere` before the weights are bound, so `bind` asks the store
for none of their tensors, and their slot caches are `Absent` (no bytes). The same family code runs what is held:
layer indices, cache lists and routes keep the whole model's numbering.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import ColibriError
from ..models.base import layer_of

ENDS = ("model.embed_tokens", "model.norm", "lm_head")  # what the head runs: embedding, final norm, head


class Absent:
    """A slot's cache of a layer held elsewhere: nothing stored, nothing to copy or move."""

    POS_DIM = 0
    nbytes = 0
    elsewhere = True

    def parts(self) -> dict[str, torch.Tensor]:
        return {}

    def to(self, device) -> Absent:
        return self


class _NoAttention(nn.Module):
    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types=None) -> Absent:
        return Absent()


class Elsewhere(nn.Module):
    """Layer `index`, held by another process: running it here is a bug, not a fallback."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.self_attn = _NoAttention()

    def forward(self, h: torch.Tensor, kv) -> torch.Tensor:
        raise RuntimeError(f"layer {self.index} is held by another cluster stage")


class _Gone(nn.Module):
    """The embedding, final norm or head on a stage that does not run them."""

    def forward(self, *a):
        raise RuntimeError("the embedding, final norm and head run on the cluster's head")


def hold(model: nn.Module, lo: int, hi: int, ends: bool) -> Callable[[str], bool]:
    """Keep layers [lo, hi) of `model` (and the embedding, final norm and head where `ends`), replacing the rest in
    place; returns the store's `keep(name)` filter for the tensors that are left. Refuses a family whose model has
    parts outside its layers and ends (they would be neither here nor anywhere)."""
    extra = [n for n, _ in model.named_children() if n not in ("model", "lm_head")]
    extra += [f"model.{n}" for n, _ in model.model.named_children() if n not in ("embed_tokens", "layers", "norm")]
    if extra:
        raise ColibriError(f"{type(model).__module__.rsplit('.', 1)[-1]}: parts outside its layers "
                           f"({', '.join(extra)}): this family does not split into cluster stages yet")
    blocks = model.model.layers
    for i in range(len(blocks)):
        if not lo <= i < hi:
            blocks[i] = Elsewhere(i)
    if not ends:
        model.model.embed_tokens, model.model.norm, model.lm_head = _Gone(), _Gone(), _Gone()

    def keep(name: str) -> bool:
        i = layer_of(name)
        return lo <= i < hi if i is not None else ends and name.startswith(ENDS)
    return keep
