"""Every family's native bf16 path (the C kernels: routers, fused attention / MLA / MoE blocks) against
torch's bf16 path on the same file, both measured against the f32 container (the transformers-exact
oracle). The native path must be as accurate as torch's: a kernel bug that bf16-vs-bf16 comparisons share
(gpt-oss's router once weighted its top expert wrongly on both the bf16 and the quantized runs) shows here.
The oracle tests run f32, where the kernels never run."""

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


@pytest.mark.parametrize("model_type", FAMILIES)
def test_native_bf16_is_as_accurate_as_torchs(ckpt, monkeypatch, model_type):
    f32, bf16 = ckpt.coli(model_type, "f32"), ckpt.coli(model_type, "bf16")
    for name, logits in (("prefill", _prefill_logits), ("decode", _decode_logits)):
        ref = logits(f32, monkeypatch, False)
        nat, tor = (_quality(logits(bf16, monkeypatch, use), ref) for use in (True, False))
        print(f"{model_type} {name} bf16 vs f32: native cosine/top-1 {nat}, torch {tor}")
        assert nat[0] >= tor[0] - 0.01 and nat[1] >= tor[1] - 0.15, (name, nat, tor)

