"""gpt-oss pieces on hand-built inputs (sinks, clamped SwiGLU, router, expert layout, MXFP4) and an
MXFP4 checkpoint converted end to end against the same weights stored plainly."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import hf_logits, load_hf
from safetensors import safe_open
from safetensors.torch import save_file

import colibri
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.layers import attention
from colibri.layers.attention import attend
from colibri.models.gpt_oss import (
    SoftmaxTopKRouter,
    check_config,
    clamped_swiglu,
    expert_record,
    mxfp4_dequantize,
)

# ----------------------------------------------------------------------------- attention sinks


def test_sink_joins_the_denominator_only():
    # One head, one query at position 2 over keys 0..2; q.k scaled gives logits [0, ln 2, ln 3].
    q = torch.ones(1, 1, 1)
    k = torch.tensor([0.0, math.log(2), math.log(3)]).view(1, 3, 1)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).view(1, 3, 2)
    sink = torch.tensor([math.log(4)])  # exp = 4 joins 1 + 2 + 3 in the denominator
    out = attend(q, k, v, start=2, scale=1.0, sinks=sink)
    want = (1 * torch.tensor([1.0, 0.0]) + 2 * torch.tensor([0.0, 1.0]) + 3 * torch.tensor([1.0, 1.0])) / 10
    torch.testing.assert_close(out, want.view(1, 2), atol=1e-6, rtol=0)


def test_sink_with_sliding_window_and_gqa():
    # Window 2 at query position 3: only keys 2 and 3 count; 2 query heads share one kv head.
    q = torch.tensor([1.0, 2.0]).view(2, 1, 1)
    k = torch.tensor([5.0, 5.0, 0.0, math.log(3)]).view(1, 4, 1)
    v = torch.tensor([7.0, 7.0, 1.0, 2.0]).view(1, 4, 1)
    sinks = torch.tensor([0.0, math.log(2)])
    out = attend(q, k, v, start=3, scale=1.0, window=2, sinks=sinks)
    h0 = (1 * 1 + 3 * 2) / (1 + 3 + 1)  # head 0: exp(0), exp(ln 3), sink exp(0)
    h1 = (1 * 1 + 9 * 2) / (1 + 9 + 2)  # head 1: logits doubled -> exp(0), 9; sink 2
    torch.testing.assert_close(out, torch.tensor([[h0, h1]]), atol=1e-6, rtol=0)


def test_minus_infinite_sink_is_plain_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 5, 8, generator=g)  # [H, T, D]
    k, v = torch.randn(2, 9, 8, generator=g), torch.randn(2, 9, 8, generator=g)  # [Hkv, S, D]
    sinks = torch.full((4,), float("-inf"))
    for window in (None, 3):
        torch.testing.assert_close(attend(q, k, v, 4, 0.3, window, sinks), attend(q, k, v, 4, 0.3, window))
        decode = q[:, -1:]  # one query at position 8 (decode: the window is the newest keys)
        torch.testing.assert_close(attend(decode, k, v, 8, 0.3, window, sinks), attend(decode, k, v, 8, 0.3, window))


def test_sink_path_in_query_chunks_equals_one_pass(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 7, 8, generator=g)  # 7 new queries at positions 5..11
    k, v = torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    for window in (None, 4):
        whole = attend(q, k, v, 5, 0.3, window, sinks)
        monkeypatch.setattr(attention, "SINK_CHUNK_SCORES", 4 * 12 * 3)  # 3 queries per chunk: 3 + 3 + 1
        torch.testing.assert_close(attend(q, k, v, 5, 0.3, window, sinks), whole, atol=1e-6, rtol=0)
        monkeypatch.undo()


# ----------------------------------------------------------------------------- experts and router


def test_clamped_swiglu_by_hand():
    alpha, limit = 1.702, 7.0
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    gate = torch.tensor([10.0, -10.0, 0.5])
    up = torch.tensor([-9.0, 9.0, 0.25])
    want = [
        (-7 + 1) * 7 * sig(7 * alpha),  # gate clamped to +7, up to -7
        (7 + 1) * -10 * sig(-10 * alpha),  # gate not clamped from below, up clamped to +7
        (0.25 + 1) * 0.5 * sig(0.5 * alpha),  # the (up + 1) term
    ]
    got = clamped_swiglu(torch.cat((gate, up)), alpha, limit)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)


def test_router_bias_then_softmax_over_the_chosen_k():
    r = SoftmaxTopKRouter(4, 4, 2)
    r.weight.data = torch.eye(4)
    r.bias.data = torch.tensor([0.0, -2.5, 0.0, 0.0])
    idx, w = r(torch.tensor([[1.0, 3.0, 0.0, 2.0]]))
    # logits [1, 0.5, 0, 2]: expert 1 (3 before the bias) loses; softmax over {3: 2, 0: 1} only
    got = dict(zip(idx[0].tolist(), w[0].tolist()))
    assert sorted(got) == [0, 3]
    assert got[3] == pytest.approx(1 / (1 + math.exp(-1)), abs=1e-6)
    assert got[0] == pytest.approx(1 / (1 + math.exp(1)), abs=1e-6)


def test_expert_record_deinterleaves_and_transposes():
    # H = 2, I = 2. gate_up [H, 2I] columns are g0 u0 g1 u1; value = 10 * h + column.
    gate_up = torch.tensor([[0.0, 1, 2, 3], [10, 11, 12, 13]])
    rec = expert_record({"gate_up": gate_up, "gate_up_bias": torch.tensor([100.0, 101, 102, 103]),
                         "down": torch.tensor([[1.0, 2], [3, 4]]), "down_bias": torch.tensor([5.0, 6])})
    assert rec["gate_up.weight"].tolist() == [[0, 10], [2, 12], [1, 11], [3, 13]]  # g0 g1 u0 u1, [2I, H]
    assert rec["gate_up.bias"].tolist() == [100, 102, 101, 103]
    assert rec["down.weight"].tolist() == [[1, 3], [2, 4]]  # [H, I]
    assert rec["down.bias"].tolist() == [5, 6]


# ----------------------------------------------------------------------------- MXFP4

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_mxfp4_dequantize_hand_built_blocks():
    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21  # low nibble 1 (+0.5) -> column 0, high nibble 2 (+1.0) -> column 1
    blocks[0, 0, 1] = 0xF8  # low 8 (-0.0) -> column 2, high 15 (-6.0) -> column 3
    blocks[0, 1, 15] = 0x7D  # low 13 (-3.0) -> column 62, high 7 (+6.0) -> column 63
    scales = torch.tensor([[128, 125]], dtype=torch.uint8)  # 2 ** 1 for block 0, 2 ** -2 for block 1
    out = mxfp4_dequantize(blocks, scales)
    want = torch.zeros(1, 64)
    want[0, :4] = torch.tensor([1.0, 2.0, -0.0, -12.0])
    want[0, 62:] = torch.tensor([-0.75, 1.5])
    assert out.shape == (1, 64)
    assert torch.equal(out, want)


def test_mxfp4_matches_transformers_dequantizer():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 4, 2, 16), generator=g, dtype=torch.uint8)  # [E, out, in/32, 16]
    scales = torch.randint(118, 136, (2, 4, 2), generator=g, dtype=torch.uint8)
    ref = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for e in range(2):
        assert torch.equal(mxfp4_dequantize(blocks[e], scales[e]).T, ref[e])


def test_mxfp4_rejects_mismatched_scales():
    with pytest.raises(ColibriError, match="MXFP4"):
        mxfp4_dequantize(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Independent encoder: w [R, C] -> blocks [R, C/32, 16], scales [R, C/32], and the values they hold."""
    R, C = w.shape
    b = w.float().view(R, C // 32, 32)
    e = torch.ceil(torch.log2(b.abs().amax(-1).clamp_min(1e-20) / 6)).to(torch.int32)  # [R, G]
    x = b / torch.exp2(e.float())[..., None]  # |x| <= 6
    mag = (x.abs()[..., None] - MAGNITUDES).abs().argmin(-1)  # [R, G, 32] in 0..7
    code = mag | ((x < 0).long() << 3)
    held = torch.where(x < 0, -1.0, 1.0) * MAGNITUDES[mag] * torch.exp2(e.float())[..., None]
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8), held.view(R, C)


def _mxfp4_checkpoint(src, plain_dir, mx_dir) -> None:
    """From a tiny gpt-oss folder: experts snapped to MXFP4 values, stored plainly and MXFP4-packed."""
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    plain, packed = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        enc = [mxfp4_encode(t[e].T) for e in range(t.shape[0])]  # each [out, in]
        plain[name] = torch.stack([held.T for _, _, held in enc]).contiguous()  # back to [E, in, out]
        del packed[name]
        packed[f"{name}_blocks"] = torch.stack([b for b, _, _ in enc])  # [E, out, in/32, 16]
        packed[f"{name}_scales"] = torch.stack([s for _, s, _ in enc])  # [E, out, in/32]
    cfg = json.loads((src / "config.json").read_text())
    for folder, ts, extra in ((plain_dir, plain, {}),
                              (mx_dir, packed, {"quantization_config": {"quant_method": "mxfp4"}})):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
        save_file(ts, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))


def test_mxfp4_checkpoint_matches_plain_and_transformers(ckpt, tmp_path):
    plain_dir, mx_dir = tmp_path / "plain", tmp_path / "mxfp4"
    _mxfp4_checkpoint(ckpt.hf("gpt_oss"), plain_dir, mx_dir)
    ids = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3] * 2
    def engine(folder):
        return colibri.load(convert(folder, tmp_path / f"{folder.name}.coli", "f32", progress=False),
                            ctx_size=64, threads=2)

    plain, mx = engine(plain_dir), engine(mx_dir)
    assert torch.equal(mx.logits(ids), plain.logits(ids))  # dequantization is exact
    ref = hf_logits(load_hf(plain_dir), ids)
    assert (plain.logits(ids) - ref).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------- config


def test_check_config():
    base = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    check_config(base)
    check_config({**base, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ColibriError, match="quant_method='bitsandbytes'"):
        check_config({**base, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ColibriError, match="layer_types entry 'chunked_attention'"):
        check_config({**base, "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ColibriError, match="layer_types has 1 entries"):
        check_config({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ColibriError, match="rope_type='dynamic'"):
        check_config({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})


def test_expert_layout_matches_reference_forward():
    """The canonical record run as y = W x + b reproduces the checkpoint's x @ W + b (gate/up interleaved)."""
    g = torch.Generator().manual_seed(0)
    hidden, inter = 8, 6
    gu, gub = torch.randn(hidden, 2 * inter, generator=g), torch.randn(2 * inter, generator=g)
    dn, dnb = torch.randn(inter, hidden, generator=g), torch.randn(hidden, generator=g)
    x = torch.randn(3, hidden, generator=g)
    h = x @ gu + gub  # [T, 2I], interleaved
    gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
    want = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ dn + dnb
    rec = expert_record({"gate_up": gu, "gate_up_bias": gub, "down": dn, "down_bias": dnb})
    act = clamped_swiglu(F.linear(x, rec["gate_up.weight"], rec["gate_up.bias"]), 1.702, 7.0)
    got = F.linear(act, rec["down.weight"], rec["down.bias"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
