"""Every family's native path (the C kernels: routers, fused attention / MLA / MoE blocks, int8 / int4
GEMVs) against torch's path on the same file (bf16, int8, int4), both measured against the f32 container
(the transformers-exact oracle). The native path must be as accurate as torch's: a kernel bug that
native-vs-native comparisons share (gpt-oss's router once weighted its top expert wrongly on its bf16 and
quantized runs alike) shows here. The oracle tests run f32, where the kernels never run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_native import _decode_logits
from test_tiers import FAMILIES, PROMPT

import colibri
from colibri.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels did not build here")


def _prefill_logits(path, monkeypatch: pytest.MonkeyPatch, use_native: bool) -> torch.Tensor:
    with monkeypatch.context() as mp:
        if not use_native:
            mp.setattr(native, "available", lambda: False)
        with colibri.load(path, ctx_size=64, threads=2) as llm:
            return llm.logits(PROMPT * 3).float()  # [36, V]: prompt rows in one step


def _quality(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return F.cosine_similarity(got, ref, dim=-1).mean().item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()


# How much less accurate than torch's path the native one may be (cosine, top-1): bf16 is rounding only; int8's
# native kernels also quantize activations (docs/QUANT.md), int4's where widths allow.
MARGINS = {"bf16": (0.01, 0.15), "int8": (0.02, 0.2), "int4": (0.03, 0.2)}


@pytest.mark.parametrize("scheme", list(MARGINS))
@pytest.mark.parametrize("model_type", FAMILIES)
def test_native_is_as_accurate_as_torchs(ckpt, monkeypatch, model_type, scheme):
    f32, path = ckpt.coli(model_type, "f32"), ckpt.coli(model_type, scheme)
    for name, logits in (("prefill", _prefill_logits), ("decode", _decode_logits)):
        ref = logits(f32, monkeypatch, False)
        nat, tor = (_quality(logits(path, monkeypatch, use), ref) for use in (True, False))
        print(f"{model_type} {scheme} {name} vs f32: native cosine/top-1 {nat[0]:.4f}/{nat[1]:.2f}, "
              f"torch {tor[0]:.4f}/{tor[1]:.2f}")
        assert nat[0] >= tor[0] - MARGINS[scheme][0] and nat[1] >= tor[1] - MARGINS[scheme][1], (name, nat, tor)
