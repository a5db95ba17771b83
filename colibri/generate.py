"""Sampling helpers kept at their old import path (the engine's own live in colibri/engine/sampling.py)."""

from __future__ import annotations

from .engine.request import RequestStats as Stats
from .engine.sampling import apply_repetition_penalty, make_sampler

__all__ = ["Stats", "apply_repetition_penalty", "make_sampler"]
