"""Calibrated quantization (`convert --calibration`) and the converter's reported int8 fallbacks."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest
import torch

from colibri.analysis.perplexity import perplexity
from colibri.cli import main
from colibri.convert import calibrate as C
from colibri.convert.converter import convert
from colibri.demo import DEMO_HF
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.quant import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import make_demo_model as demo  # noqa: E402  (the demo's story generator: calibration and evaluation text)


def _layout(path: Path) -> dict[str, tuple]:
    """Everything about each stored tensor except its bytes' checksum."""
    with Container(path) as c:
        return {n: tuple((k, str(v)) for k, v in sorted(c.info(n).items()) if not k.startswith("crc32"))
                for n in c.names()}


def test_calibrated_int4_keeps_the_layout_and_lowers_kl_on_the_demo(tmp_path):
    """The demo model is trained, so its activations have real structure; texts come from the generator
    with seeds other than the training corpus's."""
    calib, evaluation = tmp_path / "calib.txt", demo.make_corpus(n_stories=40, seed=demo.SEED + 2)
    calib.write_text(demo.make_corpus(n_stories=25, seed=demo.SEED + 1), encoding="utf-8")
    ref = convert(DEMO_HF, tmp_path / "bf16.coli", "bf16", progress=False)
    plain = convert(DEMO_HF, tmp_path / "int4.coli", "int4", 64, progress=False)
    cal = convert(DEMO_HF, tmp_path / "int4-cal.coli", "int4", 64, progress=False, calibration=calib)
    assert _layout(cal) == _layout(plain)  # names, dtypes, shapes, offsets, quant attrs: canonical
    assert abs(plain.stat().st_size - cal.stat().st_size) < 200  # the header's calibration note only
    with Container(cal) as c, Container(plain) as p:
        assert "calib.txt" in c.quant["calibration"] and "calibration" not in p.quant
        assert not torch.equal(c.tensor("model.layers.0.mlp.experts.0.down.weight"),
                               p.tensor("model.layers.0.mlp.experts.0.down.weight"))
    kl_plain = perplexity(plain, evaluation, 128, kl_base=ref, threads=1, progress=False).kl
    kl_cal = perplexity(cal, evaluation, 128, kl_base=ref, threads=1, progress=False).kl
    # measured 0.51x at this size (docs/QUANT.md has the full-size figures); 0.8 leaves room for BLAS noise
    assert kl_cal.mean_kl < 0.8 * kl_plain.mean_kl, (kl_cal.mean_kl, kl_plain.mean_kl)


def test_gptq_lowers_the_output_error_on_correlated_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    mix = torch.randn(128, 128, generator=g) * torch.logspace(0, -2, 128)  # correlated, uneven channels
    x = torch.randn(2048, 128, generator=g) @ mix
    h = x.T.double() @ x.double() / len(x)

    def out_err(q: dict[str, torch.Tensor]) -> float:
        return ((x @ (dequantize(q, "int4", w.shape, 32) - w).T) ** 2).mean().item()

    plain, gptq = out_err(quantize(w, "int4", 32)), out_err(C.quantize_gptq(w, "int4", 32, h))
    weighted = out_err(C.quantize_weighted(w, "int4", 32, h.diagonal().float()))
    assert gptq < 0.7 * plain and weighted < plain, (plain, weighted, gptq)
    for scheme, q in (("int3", C.quantize_gptq(w, "int3", 32, h)), ("int2", C.quantize_weighted(w, "int2", 32, None))):
        want = quantize(w, scheme, 32)  # the canonical tensors, nothing else
        assert {k: (v.dtype, v.shape) for k, v in q.items()} == {k: (v.dtype, v.shape) for k, v in want.items()}


def test_expert_statistics_blend_with_the_layer_prior():
    s = C.ActivationStats()
    layer = "model.layers.0.mlp.experts"
    busy = torch.tensor([[2.0, 0.0], [2.0, 0.0]]).repeat(500, 1)  # 1000 rows: x^2 = (4, 0)
    s.add(f"{layer}.0.gate_up.weight", busy)
    s.add(f"{layer}.0.down.weight", busy)
    s.add(f"{layer}.1.gate_up.weight", torch.tensor([[0.0, 1.0]]))  # one row: x^2 = (0, 1)
    # an expert with no tokens: gate_up gets the layer's pooled E[x^2], down a flat prior at its mean
    assert torch.allclose(s.importance(f"{layer}.2.gate_up.weight"), torch.tensor([4000, 1]) / 1001)
    assert torch.allclose(s.importance(f"{layer}.2.down.weight"), torch.tensor([2.0, 2.0]))
    # the expert with one row is mostly the prior; the busy one mostly itself
    one = s.importance(f"{layer}.1.gate_up.weight")
    assert one[0] > 3 and one[1] < 0.1
    assert s.importance(f"{layer}.0.gate_up.weight")[0] > 3.9
    assert s.importance("model.layers.0.self_attn.q_proj.weight") is None  # never seen: uniform


def test_statistics_file_round_trip(tmp_path, ckpt):
    model = ckpt.coli("mixtral", "bf16")
    from hf_tiny import TRAIN_TEXT

    stats = C.gather(model, TRAIN_TEXT, ctx_size=64, threads=1, progress=False)
    stats.save(tmp_path / "stats.safetensors")
    back = C.ActivationStats.load(tmp_path / "stats.safetensors")
    assert back.counts == stats.counts and back.full == stats.full
    assert all(torch.equal(back.sums[k], stats.sums[k]) for k in stats.sums)
    n_tokens = stats.counts["lm_head.weight"]  # every token reaches the output projection once
    experts = [k for k in stats.counts if k.startswith("model.layers.0.mlp.experts.") and "gate_up" in k]
    assert sum(stats.counts[k] for k in experts) == 2 * n_tokens  # top-2: each token reaches two experts
    a = convert(ckpt.hf("mixtral"), tmp_path / "a.coli", "int4", 32, progress=False, calibration=stats)
    b = convert(ckpt.hf("mixtral"), tmp_path / "b.coli", "int4", 32, progress=False,
                calibration=tmp_path / "stats.safetensors")
    with Container(a) as ca, Container(b) as cb:
        assert all(torch.equal(ca.tensor(n), cb.tensor(n)) for n in ca.names())


def test_calibration_needs_a_group_scheme_and_a_file(ckpt, tmp_path):
    with pytest.raises(ColibriError, match="int4/int3/int2"):
        convert(ckpt.hf("mixtral"), tmp_path / "x.coli", "int8", calibration=tmp_path)
    with pytest.raises(ColibriError, match="not found"):
        convert(ckpt.hf("mixtral"), tmp_path / "x.coli", "int4", 32, calibration=tmp_path / "none.txt")


@pytest.mark.parametrize("calibrated", [False, True])
def test_group_size_that_does_not_divide_is_a_reported_fallback(ckpt, tmp_path, capsys, calibrated):
    """tiny mixtral: hidden 64, expert intermediate 96 -> with group 64 every expert `down` is int8."""
    text = tmp_path / "calib.txt"
    from hf_tiny import TRAIN_TEXT

    text.write_text(TRAIN_TEXT, encoding="utf-8")
    out = tmp_path / "g64.coli"
    rc = main(["convert", "-i", str(ckpt.hf("mixtral")), "-o", str(out), "--quant", "int4", "--group-size", "64",
               "--no-progress", *(["--calibration", str(text)] if calibrated else [])])
    err = capsys.readouterr().err
    assert rc == 0 and "stored as int8, not int4" in err
    with Container(out) as c:
        fallback = c.meta["quant_fallback"]
        int8 = {n for n in c.names() if c.info(n).get("quant", {}).get("scheme") == "int8" and n != "lm_head.weight"}
        assert int8 and all(c.info(n)["quant"]["scheme"] == "int4" for n in c.names()
                            if "quant" in c.info(n) and n not in int8 and n != "lm_head.weight")
    # every int8 weight is listed (experts as one pattern per layer), and every listed pattern is int8
    assert all(any(fnmatch.fnmatchcase(n, pat) for pat in fallback) for n in int8)
    assert all(any(fnmatch.fnmatchcase(n, pat) for n in int8) for pat in fallback)
    assert set(fallback) == {f"model.layers.{i}.mlp.experts.*.down.weight" for i in range(3)}
    assert all("96" in why and "64" in why for why in fallback.values())
    assert main(["inspect", str(out), "--no-verify"]) == 0
    shown = capsys.readouterr().out
    assert "fallback:    3 weights not in int4" in shown
    assert all(pat in shown for pat in fallback)


@pytest.mark.parametrize("case, message", [
    ("other-model", "input channels"),  # tiny mixtral's statistics (hidden 64) for the demo (hidden 128)
    ("garbage", "not a readable statistics file"),
    ("missing", "not found"),
])
def test_cli_bad_calibration_is_one_line(ckpt, tmp_path, capsys, case, message):
    stats = tmp_path / "stats.safetensors"
    if case == "other-model":
        from hf_tiny import TRAIN_TEXT

        C.gather(ckpt.coli("mixtral", "bf16"), TRAIN_TEXT, ctx_size=64, threads=1, progress=False).save(stats)
    elif case == "garbage":
        stats.write_bytes(b"not safetensors at all")
    out = tmp_path / "x.coli"
    rc = main(["convert", "-i", str(DEMO_HF), "-o", str(out), "--quant", "int4", "--no-progress",
               "--calibration", str(stats)])
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists()
    lines = err.strip().splitlines()
    assert lines[-1].startswith("colibri: error:") and message in lines[-1], err
    assert not any("Traceback" in line for line in lines)


def test_statistics_under_a_budget_pool_the_experts_gate_up(ckpt, tmp_path):
    """Full statistics that do not fit: x x^T for each MoE layer's pooled gate_up input, then dense linears
    while the budget lasts; every expert's own statistics diagonal."""
    from hf_tiny import TRAIN_TEXT

    model = ckpt.coli("mixtral", "bf16")
    full = C.gather(model, TRAIN_TEXT, ctx_size=64, threads=1, progress=False, full=True)
    layers = sorted({C._expert_name(k)[0] for k in full.sums if C._expert_name(k)})
    hidden = full.sums[f"{layers[0]}.0.gate_up.weight"].shape[0]
    budget = 8 * hidden**2 * (len(layers) + 2)  # the pooled matrices and two dense linears' worth
    part = C.gather(model, TRAIN_TEXT, ctx_size=64, threads=1, progress=False, max_full_bytes=budget)
    assert not part.full and sum(8 * t.numel() for t in part.sums.values() if t.dim() == 2) <= budget
    dense_full = [k for k, t in part.sums.items() if t.dim() == 2 and not C._expert_name(k) and C.POOLED not in k]
    assert 1 <= len(dense_full) < len([k for k in full.sums if not C._expert_name(k)])
    for layer in layers:
        shared = f"{layer}.{C.POOLED}.gate_up.weight"
        own = [k for k in full.sums if C._expert_name(k) == (layer, "gate_up.weight")]
        # the pooled matrix is every expert's x x^T summed, the experts' own entries are diagonals
        assert torch.allclose(part.sums[shared], sum(full.sums[k] for k in own), rtol=1e-6)
        assert part.counts[shared] == sum(full.counts[k] for k in own)
        assert all(part.sums[k].dim() == 1 and part.counts[k] == full.counts[k] for k in own)
        assert torch.equal(part.second_moment(own[0]), part.sums[shared] / part.counts[shared])
        assert part.second_moment(f"{layer}.0.down.weight").dim() == 1  # down: diagonal, weighted search
    part.save(tmp_path / "s.safetensors")
    assert C.ActivationStats.load(tmp_path / "s.safetensors").full_names == part.full_names
    out = convert(ckpt.hf("mixtral"), tmp_path / "b.coli", "int4", 32, progress=False, calibration=part)
    assert _layout(out) == _layout(convert(ckpt.hf("mixtral"), tmp_path / "p.coli", "int4", 32, progress=False))
