"""Shared fixtures: tiny HF checkpoints (built once per session) and their f32 containers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)

from hf_tiny import make_tiny_checkpoint  # noqa: E402

from colibri.convert import convert  # noqa: E402


class Checkpoints:
    """Builds (once) tiny HF folders and containers, keyed by their settings."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def hf(self, model_type: str, fused: bool = False, **overrides) -> Path:
        key = ("hf", model_type, fused, tuple(sorted(overrides.items())))
        if key not in self.done:
            name = f"{model_type}{'_fused' if fused else ''}_{len(self.done)}"
            self.done[key] = make_tiny_checkpoint(model_type, self.root / name, fused=fused, **overrides)
        return self.done[key]

    def coli(self, model_type: str, scheme: str = "f32", fused: bool = False, group_size: int = 32,
             **overrides) -> Path:
        key = ("coli", model_type, scheme, fused, group_size, tuple(sorted(overrides.items())))
        if key not in self.done:
            src = self.hf(model_type, fused, **overrides)
            self.done[key] = convert(src, self.root / f"{src.name}.{scheme}.g{group_size}.coli", scheme,
                                     group_size, progress=False)
        return self.done[key]


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("ckpt"))
