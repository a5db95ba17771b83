"""The decode plan (colibri/engine/decode_plan.py): chosen once at load and named, and a range of layers at a time
gives the bits of the whole step (the seam pipeline stages and verify rows run through)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_native import PROMPTS

import colibri
from colibri.engine.decode_plan import DecodePlan
from colibri.kernels import native
from colibri.layers.batch import Seq, StepBatch


def _whole_and_halves(llm, plan: DecodePlan, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the same steps (a 5-row prompt chunk, one-row steps, a two-sequence step) run by `plan.step` on
    slot 0 / 1 and by embed -> layers [0, m) -> layers [m, L) -> head on slots 2 / 3."""
    L = plan.n_layers
    out = []
    for whole in (True, False):
        a, b = llm.slots.caches[0:2] if whole else llm.slots.caches[2:4]

        def step(tokens: list[int], batch: StepBatch, rows: torch.Tensor, whole: bool = whole) -> torch.Tensor:
            ids = torch.tensor(tokens)
            if whole:
                return plan.step(ids, batch, rows)
            h = plan.layers(plan.embed(ids), batch, 0, m)
            return plan.head(plan.layers(h, batch, m, L), rows)

        got = []
        with torch.inference_mode():
            got.append(step(PROMPTS[0][:5], StepBatch.single(a, 0, 5), torch.arange(5)))
            for pos in range(5, 9):
                got.append(step([PROMPTS[0][pos]], StepBatch.single(a, pos, 1), torch.tensor([0])))
            got.append(step(PROMPTS[1][:3], StepBatch.single(b, 0, 3), torch.tensor([2])))
            batch = StepBatch([Seq(0, 1, 9, a), Seq(1, 2, 3, b)])
            got.append(step([5, 6], batch, torch.tensor([0, 1])))
        out.append(torch.cat(got))
    return out[0], out[1]


@pytest.mark.parametrize("model_type,scheme", [("olmoe", "f32"), ("deepseek_v3", "f32"), ("olmoe", "int8"),
                                               ("qwen3_moe", "int4")])
def test_two_halves_give_the_bits_of_the_whole(ckpt, model_type, scheme, monkeypatch) -> None:
    """Layers [0, m) then [m, L) over the same rows equal the whole step bit for bit; at int8/int4 each half
    runs natively in one call (its own constants for its range), so a stage of a pipeline is the plan's own."""
    llm = colibri.load(ckpt.coli(model_type, scheme), ctx_size=32, slots=4, threads=2)
    try:
        L = llm.n_layers
        assert L >= 2
        calls: list[int] = []
        if scheme != "f32" and native.available():
            real = native.decode_layers
            monkeypatch.setattr(native, "decode_layers", lambda attn, *a, **k: calls.append(len(attn)) or real(
                attn, *a, **k))
        whole, halves = _whole_and_halves(llm, llm.plan, L // 2)
    finally:
        llm.close()
    assert torch.equal(whole, halves)
    assert whole.shape[0] == 5 + 4 + 1 + 2 and torch.isfinite(whole).all()
    if scheme != "f32" and native.available():  # each half a call of its own range's layers, on every step
        assert calls.count(L // 2) >= 6 and calls.count(L - L // 2) >= 6


def test_plan_names_its_backend_and_reasons(ckpt, monkeypatch) -> None:
    """The plan says which backend runs which layers and why; COLIBRI_NATIVE=0 (the kernels off) reaches it."""
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=32, threads=2) as llm:
        line = llm.plan.describe()
        assert line.startswith("decode plan: layers 0-") and " torch (" in line and "float32" in line
        assert llm.plan.native_layers() is None
    if native.available():
        with colibri.load(ckpt.coli("olmoe", "int8"), ctx_size=32, threads=2) as llm:
            line = llm.plan.describe()
            assert " native (one call a step, with the embedding and head" in line
            assert llm.plan.native_layers() is not None
            llm.plan.rebuild(native=False)
            assert " torch (asked for torch)" in llm.plan.describe()
            assert list(llm.generate_ids([1, 2, 3], 4, temperature=0, ignore_eos=True))  # still decodes
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "why_unavailable", lambda: "disabled by COLIBRI_NATIVE=0")
    with colibri.load(ckpt.coli("olmoe", "int8"), ctx_size=32, threads=2) as llm:
        assert "torch (native kernels unavailable: disabled by COLIBRI_NATIVE=0)" in llm.plan.describe()


def test_layer_range_is_checked(ckpt) -> None:
    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=32, threads=2) as llm:
        h = torch.zeros(1, llm.model.model.embed_tokens.dim)
        with pytest.raises(ValueError, match="outside the model"):
            llm.plan.layers(h, StepBatch.single(llm.slots.caches[0], 0, 1), 1, llm.n_layers + 1)


def test_run_prints_the_plan_at_info(ckpt) -> None:
    """`colibri run --log-level info` names the plan once, at load."""
    path = ckpt.coli("olmoe", "int8")
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "--model", str(path), "--prompt", "hi", "-n", "2",
                        "--ctx-size", "32", "--log-level", "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "decode plan: " in ln]
    assert len(lines) == 1 and "layers 0-" in lines[0]
