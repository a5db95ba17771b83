"""Prompt cache files: one slot's token ids and their K/V on disk (llama.cpp's `--prompt-cache`).

A long prompt is computed once; the next run with the same model loads its K/V into a slot and
prompt caching (engine/kv.py) skips whatever prefix the new prompt shares with it. The file is a
`torch.save` of plain tensors and lists, read back with `weights_only=True` (no code runs from it),
and it names the model it belongs to (a hash of the container's header, which holds every
tensor's checksum), the compute dtype, the K/V storage types (a quantized cache is saved as its quantized
rows) and every layer's shapes: a file of another model, dtype, cache type or shape is refused with a clear
error, never loaded into the wrong cache. Format 1 (before quantized caches) had no types: its files hold the
compute dtype's K/V and still load into such a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from ..errors import ColibriError
from ..layers.kvquant import KVTypes
from .kv import SlotPool, positions

FORMAT = "colibri-prompt-cache/2"
FORMATS = ("colibri-prompt-cache/1", FORMAT)  # (1: no "kv" entry, always the compute dtype's K/V)


def model_identity(header: dict, dtype: torch.dtype) -> str:
    """What a file must match: the container's header (tensor names, shapes, checksums) and the dtype."""
    h = hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode())
    return f"{h.hexdigest()[:32]}/{dtype}"


def save(pool: SlotPool, slot: int, path: str | os.PathLike, identity: str) -> int:
    """Write the slot's tokens and their K/V; returns the positions written (0: nothing to save)."""
    _check_rewindable(pool)
    tokens = list(pool.tokens[slot])
    n = len(tokens)
    if n == 0:
        return 0
    state = {"format": FORMAT, "model": identity, "kv": str(pool.types),
             "tokens": torch.tensor(tokens, dtype=torch.int64),
             "layers": [{k: t.cpu() for k, t in positions(c, 0, n).items()} for c in pool.caches[slot]]}
    tmp = Path(f"{path}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    return n


def load(pool: SlotPool, slot: int, path: str | os.PathLike, identity: str) -> int:
    """Read a file written by `save` into the slot; returns the positions loaded."""
    _check_rewindable(pool)
    try:
        with warnings.catch_warnings():  # torch's notes about a foreign file's pickle: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise ColibriError(f"{path}: not a colibri prompt cache ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") not in FORMATS:
        raise ColibriError(f"{path}: not a colibri prompt cache (or one of a newer colibri)")
    if state.get("model") != identity:
        raise ColibriError(f"{path}: a prompt cache of another model or dtype")
    kv = state.get("kv", str(KVTypes()))
    if kv != str(pool.types):
        raise ColibriError(f"{path}: holds a {kv} K/V cache and this engine's is {pool.types}: load it with the "
                           "--cache-type-k/-v it was written with")
    tokens, layers = state.get("tokens"), state.get("layers")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or not isinstance(layers, list):
        raise ColibriError(f"{path}: a damaged prompt cache")
    n = tokens.shape[0]
    caches = pool.caches[slot]
    if n > pool.ctx:
        raise ColibriError(f"{path}: holds {n} positions, more than ctx-size {pool.ctx}")
    into = [positions(c, 0, n) for c in caches]  # views of the slot's caches: [layer][name]
    if len(layers) != len(caches) or any(not _fits(st, dst) for st, dst in zip(layers, into)):
        raise ColibriError(f"{path}: a damaged prompt cache (layer shapes or dtypes differ)")
    for st, dst in zip(layers, into):
        for name, t in dst.items():
            t.copy_(st[name])
    pool.tokens[slot] = tokens.tolist()
    return n


def _fits(saved, views: dict[str, torch.Tensor]) -> bool:
    """A saved layer has exactly the tensors of the cache's views, with their shapes and dtypes."""
    return isinstance(saved, dict) and saved.keys() == views.keys() and all(
        isinstance(saved[k], torch.Tensor) and saved[k].shape == v.shape and saved[k].dtype == v.dtype
        for k, v in views.items())


def _check_rewindable(pool: SlotPool) -> None:
    if not pool.rewindable:
        raise ColibriError("this model's linear-attention, convolution or Mamba layers keep a state, not K/V "
                           "positions: prompt cache files do not apply to it")
