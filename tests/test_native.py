"""The native decode kernels (colibri/kernels/*.c) against the torch paths they replace.

They change summation order only (f32 accumulation throughout), so at f32 they agree with the
dequantized weights to f32 rounding, and in bf16 to bf16 rounding of the output."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from colibri import quant
from colibri.kernels import native, native_attn
from colibri.layers.moe import ExpertWeights, SwitchGLU
from colibri.quant import QLinear, dequantize, quantize

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("scheme,g", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_qlinear_native_matches_dequantized(scheme: str, g: int, rows: int) -> None:
    torch.manual_seed(rows)
    w = torch.randn(48, 256) + 0.1
    t = quantize(w, scheme, g or 64)
    ref_w = dequantize(t, scheme, (48, 256), g or 64)
    x = torch.randn(rows, 256)
    m = QLinear.from_tensors(t, scheme, (48, 256), g or 64, None, torch.float32, kernel="native")
    assert m.path == "native" and m.nbytes == 0  # reads the canonical tensors, allocates nothing
    assert _rel(m(x), x @ ref_w.T) < 1e-5
    mb = QLinear.from_tensors(t, scheme, (48, 256), g or 64, None, torch.bfloat16, kernel="native")
    yb = mb(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and _rel(yb, x.bfloat16().float() @ ref_w.T) < 1e-2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("gated", [False, True])
def test_native_mlp_matches_dequantized(scheme: str, gated: bool) -> None:
    """coli_mlp_rows (a dense layer's or shared expert's SwiGLU, Qwen2-MoE's sigmoid gate) against torch's
    f32 math on the dequantized weights: within the rounding of the bf16 rows and activations (the kernels
    quantize them per block on the VNNI paths, as every native projection does; measured 0.4-1.2%); each
    row as it is alone."""
    from colibri.layers import native_mlp
    from colibri.layers.layers import MLP

    torch.manual_seed(gated)
    H, inter, T = 128, 192, 5
    mlp, ref = MLP(H, inter), {}

    def proj(out: int, inp: int) -> QLinear:
        w = torch.randn(out, inp) / inp**0.5
        t = quantize(w, scheme, 32)
        ref[id(t)] = dequantize(t, scheme, (out, inp), 32)
        m = QLinear.from_tensors(t, scheme, (out, inp), 32, None, torch.bfloat16, kernel="native")
        ref[m] = ref.pop(id(t))
        return m

    mlp.gate_proj, mlp.up_proj, mlp.down_proj = proj(inter, H), proj(inter, H), proj(H, inter)
    gate = proj(1, H) if gated else None
    x = torch.randn(T, H).bfloat16()
    got = native_mlp.run(mlp, x, gate)
    assert got is not None and got.dtype == torch.bfloat16
    xf = x.float()
    want = (F.silu(xf @ ref[mlp.gate_proj].T) * (xf @ ref[mlp.up_proj].T)) @ ref[mlp.down_proj].T
    if gated:
        want = torch.sigmoid(xf @ ref[gate].T) * want
    assert _rel(got, want) < 3e-2
    for t in range(T):
        assert torch.equal(native_mlp.run(mlp, x[t : t + 1], gate)[0], got[t])
    assert native_mlp.run(mlp, x.float(), gate) is None  # f32 rows: torch's ops (the oracle path)


@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_wide_rows_match_dequantized(g: int, rows: int) -> None:
    # More than 16 groups per row, and a count that is not a multiple of 16: the kernel converts the
    # scales of 16 groups at a time (rows.h q4v_row_block; one row takes its unrolled blocks).
    torch.manual_seed(g)
    t = quantize(torch.randn(40, 2304) * torch.logspace(-1, 1, 2304) + 0.1, "int4", g)  # every group its own scale
    ref_w = dequantize(t, "int4", (40, 2304), g)
    m = QLinear.from_tensors(t, "int4", (40, 2304), g, None, torch.bfloat16, kernel="native")
    x = torch.randn(rows, 2304).bfloat16()
    assert _rel(m(x), x.float() @ ref_w.T) < 1e-2


def _q8_activations_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, strided: bool) -> torch.Tensor:
    """docs/QUANT.md's int8-activation numerics in torch: blocks of 32 columns, each to int8 with the
    scale max|x| / 127 (x * (127 / max) rounded to nearest even, in f32), products in f64. `strided`:
    the kernel's blocks (per 512 columns, lane l of each 64-column chunk); else contiguous 32s."""
    T, K = x.shape
    cols = torch.arange(K)
    if strided:
        span, lane = cols // 512, (cols % 64) // 4
        block = span * 16 + lane
    else:
        block = cols // 32
    y = torch.zeros(T, q.shape[0], dtype=torch.float64)
    for b in block.unique():
        c = cols[block == b]
        a = x[:, c].abs().amax(1, keepdim=True)
        inv = torch.where(a > 0, 127.0 / a, torch.zeros_like(a))
        xq = torch.round(x[:, c] * inv).clamp(-127, 127)
        y += (a / 127.0).double() * (xq.double() @ q[:, c].double().T)
    return (y * scale.double()).float()


@pytest.mark.skipif(not native.int8_activations(), reason="a build without the int8-activation (VNNI) paths")
@pytest.mark.parametrize("K", [512, 1024, 1216])  # whole 512-column spans, and a short last one (192)
def test_int8_activation_blocks_are_the_documented_strided_ones(K: int) -> None:
    torch.manual_seed(K)
    t = quantize(torch.randn(64, K), "int8")
    q, scale = t[""].clone(), t[".scale"]
    q[:, 0] = 0  # the outlier column below meets no weight: what it costs is its block-mates' precision
    x = torch.randn(8, K)
    x[:, 0] = 300.0
    xb = x.bfloat16()
    y = native.q8_gemm(xb, q, scale).float()
    strided = _q8_activations_reference(xb.float(), q, scale, strided=True)
    contiguous = _q8_activations_reference(xb.float(), q, scale, strided=False)
    assert _rel(y, strided) < 4e-3  # the bf16 rounding of the output
    assert _rel(y, contiguous) > 2e-2  # the outlier crushed other columns than contiguous blocks say


@pytest.mark.parametrize("scheme,shape,g", [("int4", (64, 128), 32), ("int4", (200, 1024), 64),
                                             ("int8", (200, 1024), 64), ("int8", (72, 640), 64)])
def test_native_rows_are_independent(scheme: str, shape: tuple[int, int], g: int) -> None:
    # A row's result must not depend on the other rows of the call (batch == solo, bit for bit, at the
    # bf16 outputs): one row reduces 16 output rows' sums together, two rows likewise, 3-8 rows each sum
    # alone (rows.h q8v_rows, q4v_rows1), all in one order (common.h hsum16 / hsum1 -- an f32 last-bit
    # difference there seldom survives the bf16 rounding, so this checks the paths' agreement, not that
    # order). 200 output rows: the threads' pieces hold full groups of 16 and a tail; 10 rows: a block
    # of 8 and one of 2.
    torch.manual_seed(shape[0])
    t = quantize(torch.randn(*shape), scheme, g)
    m = QLinear.from_tensors(t, scheme, shape, g, None, torch.bfloat16, kernel="native")
    x = torch.randn(10, shape[1]).bfloat16()
    whole = m(x)
    assert _rel(whole, x.float() @ dequantize(t, scheme, shape, g).T) < 2e-2
    for r in range(10):
        assert torch.equal(whole[r], m(x[r : r + 1])[0])
    assert torch.equal(whole[8:], m(x[8:])) and torch.equal(whole[:3], m(x[:3]))


def test_auto_prefers_native_and_falls_back_for_large_inputs() -> None:
    t = quantize(torch.randn(32, 128), "int8")
    m = QLinear.from_tensors(t, "int8", (32, 128), 64, None, torch.bfloat16)
    assert m.path == "native" and m.fused_max_rows == quant.NATIVE_MAX_ROWS["int8"]
    big = torch.randn(m.fused_max_rows + 5, 128).bfloat16()
    ref = big.float() @ dequantize(t, "int8", (32, 128)).T
    assert _rel(m(big), ref) < 1e-2  # the dequantize-then-GEMM path


class _Resident:
    def __init__(self, experts: list[ExpertWeights], holds: bool = True):
        self.experts, self.holds = experts, holds

    def fetch(self, layer: int, ids: list[int]):
        return iter([(e, self.experts[e]) for e in ids])

    def prefetch(self, layer: int, ids: list[int]) -> None:
        pass

    def holds_all(self, layer: int) -> bool:
        return self.holds


@pytest.mark.parametrize("scheme,dt,tol", [("int8", torch.float32, 1e-5), ("int4", torch.float32, 1e-5),
                                           ("int8", torch.bfloat16, 2e-2), ("int4", torch.bfloat16, 2e-2)])
def test_fused_moe_layer_matches_per_expert_path(scheme: str, dt: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    E, H, Im, k, T = 6, 128, 64, 2, 5
    experts = [ExpertWeights(QLinear.from_dense(torch.randn(2 * Im, H) * 0.1, scheme, 32, None, dt),
                             QLinear.from_dense(torch.randn(H, Im) * 0.1, scheme, 32, None, dt)) for _ in range(E)]
    assert all(w.gate_up.path == "native" for w in experts)
    sw = SwitchGLU(0, H, Im, E)
    sw.source = _Resident(experts)
    x = torch.randn(T, H).to(dt)
    idx = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 3], [2, 4]])
    wts = torch.rand(T, k)
    y = sw(x, idx, wts)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            w = experts[int(idx[t, j])]
            gu = F.linear(x[t].float(), w.gate_up.dequantized_weight().float())
            h = F.silu(gu[:Im]) * gu[Im:]
            ref[t] += wts[t, j] * F.linear(h, w.down.dequantized_weight().float())
    assert y.dtype == dt and _rel(y, ref) < tol
    # Each row alone gives the same bits as in the batch.
    for t in range(T):
        assert torch.equal(sw(x[t : t + 1], idx[t : t + 1], wts[t : t + 1])[0], y[t])
    # A cache hands experts over one at a time (one native call each): the same bits.
    sw.source = _Resident(experts, holds=False)
    assert torch.equal(sw(x, idx, wts), y)


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("with_sinks", [False, True])
# 16-position blocks and a tail, one short of a block; Dv 64 / 128 / another; Gemma 4's heads of 256 and 512
@pytest.mark.parametrize("D,S", [(64, 37), (128, 300), (96, 21), (64, 5), (256, 40), (512, 33)])
def test_decode_attention_matches_f32_softmax(window: int | None, with_sinks: bool, D: int, S: int) -> None:
    from colibri.layers.attention import attend

    torch.manual_seed(1)
    H, Hkv = 8, 2
    q = torch.randn(H, 1, D).bfloat16()
    kc, vc = torch.randn(Hkv, S + 63, D).bfloat16(), torch.randn(Hkv, S + 63, D).bfloat16()  # a cache, longer than S
    sinks = torch.randn(H) if with_sinks else None
    y = attend(q, kc[:, :S], vc[:, :S], S - 1, 0.125, window, sinks)
    lo = max(S - window, 0) if window is not None else 0
    kf = kc[:, lo:S].float().repeat_interleave(H // Hkv, 0)
    vf = vc[:, lo:S].float().repeat_interleave(H // Hkv, 0)
    scores = (q.float() @ kf.transpose(1, 2)) * 0.125  # [H, 1, S']
    if sinks is not None:
        probs = torch.softmax(torch.cat([scores, sinks.view(H, 1, 1)], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    ref = (probs @ vf).reshape(1, -1)
    assert y.dtype == torch.bfloat16 and y.shape == (1, H * D)
    assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("D", [64, 128, 512])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_rows_of_a_chunk_give_each_rows_own_bits(D: int, with_sinks: bool) -> None:
    """A prompt chunk's rows share passes over the keys and values (ATTN_RB at a time): every row's output
    is bit-identical to its own one-row call, as a rerun from the prompt cache computes it. Rows of another
    sequence in the same call (a decode row next to the chunk) take the one-row path."""
    g = torch.Generator().manual_seed(D)
    H, Hkv, T, ctx = 8, 2, 11, 96
    k, v, k2, v2 = (torch.randn(Hkv, ctx, D, generator=g).bfloat16() for _ in range(4))
    q = torch.randn(T, H, D, generator=g).bfloat16()
    sinks = torch.randn(H, generator=g) if with_sinks else None
    S = [40 + t for t in range(T - 2)] + [7, 70]  # a causal chunk of one sequence, then two rows of another
    ks, vs = [k] * (T - 2) + [k2, k2], [v] * (T - 2) + [v2, v2]
    out = native_attn.attn_rows(q, ks, vs, S, 0.125, sinks)
    for t in range(T):
        one = native_attn.attn_decode(q[t], ks[t][:, :S[t]], vs[t][:, :S[t]], 0.125, sinks)
        assert torch.equal(out[t], one[0]), t


def test_rmsnorm_and_rope_match_f32_reference() -> None:
    from colibri.layers.layers import RMSNorm, RoPE

    torch.manual_seed(2)
    norm = RMSNorm(96, 1e-5)
    norm.weight.copy_(torch.rand(96) + 0.5)
    x = torch.randn(3, 4, 96).bfloat16()
    xf = x.float()
    ref = norm.weight * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = norm(x)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2
    # Exactly the kernel's arithmetic: one f32 inv per row (its sum of squares in the kernel's own
    # order: within an ulp or two of torch's), then w * (x * inv) in f32, rounded once -- the 16-lane
    # part and the scalar tail (width 100) alike.
    for H in (96, 100):
        nw = (torch.rand(H) + 0.5).float()
        xr = torch.randn(4, H).bfloat16()
        got = native.rmsnorm(xr, nw, 1e-5)
        for r in range(4):
            xf32 = xr[r].float()
            inv0 = torch.rsqrt(xf32.pow(2).mean() + 1e-5)
            cands, lo, hi = [inv0], inv0, inv0
            for _ in range(3):  # a few ulps either side
                lo, hi = torch.nextafter(lo, torch.tensor(0.0)), torch.nextafter(hi, torch.tensor(9.0))
                cands += [lo, hi]
            assert any(torch.equal(got[r], (nw * (xf32 * inv)).bfloat16()) for inv in cands), (H, r)
    for rot in (64, 32):  # full and partial rotary
        rope = RoPE(rot, 10000.0, max_pos=64)
        q = torch.randn(5, 3, 64).bfloat16()
        for pos in (7, torch.tensor([3, 9, 0, 20, 1])):
            got = rope(q, pos)
            ref = rope(q.float(), pos)  # the f32 torch path
            assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2
            # and exactly the kernel's arithmetic: f32 products, one sum each, one rounding to bf16
            c, s = (t[:, None] for t in rope.tables(pos, 5, torch.float32))  # [T, 1, rot]
            qf, h = q.float(), rot // 2
            x1, x2 = qf[..., :h], qf[..., h:rot]
            exact = torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:], qf[..., rot:]), -1)
            assert torch.equal(got, exact.bfloat16())


PROMPTS = [[1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3, 88, 120, 31, 9],
           [1, 250, 251, 33, 34, 35, 90, 91, 92, 17, 18, 19, 300, 301, 302, 5]]


def _decode_logits(path, monkeypatch: pytest.MonkeyPatch, use_native: bool) -> torch.Tensor:
    import colibri
    from colibri.layers.batch import StepBatch

    with monkeypatch.context() as mp:
        if not use_native:
            mp.setattr(native, "available", lambda: False)
        llm = colibri.load(path, ctx_size=64, threads=2)
        rows = []
        with torch.inference_mode():
            for ids in PROMPTS:
                caches = llm.slots.caches[0]
                for pos, tok in enumerate(ids):  # teacher-forced one-row decode steps
                    rows.append(llm.plan.step(torch.tensor([tok]), StepBatch.single(caches, pos, 1),
                                          torch.tensor([0]))[0].float())
        llm.close()
    return torch.stack(rows)


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_moe", {"moe_intermediate_size": 64}), ("mixtral", {}),
    ("qwen3_moe", {"hidden_size": 128, "moe_intermediate_size": 128}),
    # the native dense / shared MLPs (coli_mlp_rows), q/k/v biases in the attention block
    ("qwen2_moe", {"shared_expert_intermediate_size": 64}), ("glm4_moe", {"n_group": 1, "topk_group": 1}),
    ("gpt_oss", {}),  # its experts' clamped activation and biases, its router
    # MLA in one call (kernels/mla.c): q_proj, interleaved RoPE / q LoRA (int4 needs ranks of 32s)
    ("deepseek_v2", {"topk_method": "greedy", "kv_lora_rank": 32}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 32})])
@pytest.mark.parametrize("scheme,floor", [("int8", (0.95, 0.75)), ("int4", (0.7, 0.2))])
def test_decode_kernels_are_as_accurate_as_torchs(ckpt, monkeypatch, model_type, overrides, scheme, floor) -> None:
    """The decode path (native GEMVs, int8 with Q8_0-style activations, the fused MoE layer, native
    attention/norm/rotary) against the bf16 container decoding the same tokens, next to torch's decode
    path on the same files: no worse than torch's by more than a little, and above a floor that a
    broken kernel (cosine ~0) cannot reach. Expert width 64 puts qwen3_moe's int8 experts on the VNNI
    path (widths multiple of 64); mixtral's int4 experts take the vdpbf16ps path, and the 128-wide
    qwen3_moe's int4 layers the int8-activation VNNI path (widths multiple of 128). Measured (these tiny
    uniform-random models are a worst case): cosine int8 0.985 / 0.9994 native vs 0.985 / 0.9987 torch,
    int4 0.898 / 0.930 both (qwen3_moe / mixtral)."""
    import torch.nn.functional as F

    # The reference on torch's path: a native kernel the quantized and bf16 runs share cannot hide behind it
    # (gpt-oss's router once weighted its top expert wrongly in both).
    ref = _decode_logits(ckpt.coli(model_type, "bf16", **overrides), monkeypatch, False)
    q = ckpt.coli(model_type, scheme, **overrides)
    got = {}
    for use_native in (True, False):
        b = _decode_logits(q, monkeypatch, use_native)
        got[use_native] = (F.cosine_similarity(ref, b, dim=-1).mean().item(),
                           (ref.argmax(-1) == b.argmax(-1)).float().mean().item())
    print(f"{model_type} {scheme} decode vs bf16: native cosine/top-1 {got[True]}, torch {got[False]}")
    assert got[True][0] >= floor[0] and got[True][1] >= floor[1]
    assert got[True][0] >= got[False][0] - 0.02 and got[True][1] >= got[False][1] - 0.2


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_int4_dequantize_gives_torchs_bits(dt: torch.dtype) -> None:
    t = quantize(torch.randn(40, 256) + 0.2, "int4", 64)
    m = QLinear.from_tensors(t, "int4", (40, 256), 64, None, dt, kernel="native")
    assert torch.equal(m.dequantized_weight(), dequantize(t, "int4", (40, 256), 64, dt))
    assert torch.equal(m.dequantized_weight(slice(8, 24)), dequantize(t, "int4", (40, 256), 64, dt)[8:24])


def test_pool_survives_fork(tmp_path) -> None:
    """A child forked after the pool started its workers has none of them: its first parallel
    kernel must not wait for them (pool.c resets itself at fork)."""
    import subprocess
    import sys

    script = tmp_path / "fork.py"
    script.write_text(
        "import os, torch\n"
        "from colibri.kernels import native\n"
        "native.set_threads(2)\n"
        "q, s, x = torch.ones(1024, 1024, dtype=torch.int8), torch.ones(1024), torch.ones(1, 1024)\n"
        "native.q8_gemm(x, q, s)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    y = native.q8_gemm(x, q, s)\n"
        "    os._exit(0 if float(y[0, 0]) == 1024.0 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_forced_native_beyond_the_kernels_row_limit_dequantizes() -> None:
    t = quantize(torch.randn(32, 128), "int8")
    m = QLinear.from_tensors(t, "int8", (32, 128), 64, None, torch.float32, kernel="native")
    x = torch.randn(native.max_rows() + 3, 128)
    assert _rel(m(x), x @ dequantize(t, "int8", (32, 128)).T) < 1e-5



def _router(kind: str, hidden: int, experts: int, k: int, norm: bool):
    """A softmax top-k router (Mixtral's), gpt-oss's (softmax over the k biased logits kept), a sigmoid one
    with a selection bias and a weight scale, one group (MiniMax-M2's / GLM-4.5's), or a softmax one with a
    selection bias (ERNIE-4.5's: `norm` False puts its renormalisation floor above any sum), with random
    weights."""
    from colibri.layers.moe import TopKRouter
    from colibri.models.ernie4_5_moe import Router
    from colibri.models.glm4_moe import GroupLimitedRouter
    from colibri.models.gpt_oss import SoftmaxTopKRouter
    from colibri.models.phimoe import SparsemixerRouter

    if kind == "softmax":
        r = TopKRouter(hidden, experts, k, norm)
    elif kind == "topk_softmax":  # gpt-oss: biased logits, softmax over the k kept (`norm` has no say)
        r = SoftmaxTopKRouter(hidden, experts, k)
        r.bias.data = torch.randn(experts) * 0.5
    elif kind == "sparsemixer":  # Phi-3.5-MoE: always 2 experts; a jitter that keeps some candidates, some not
        r = SparsemixerRouter(hidden, experts, 0.05)
    elif kind == "softmax_bias":
        r = Router(hidden, experts, k, 1e-12 if norm else 1.5)
        r.e_score_correction_bias.data = torch.randn(1, experts) * 0.02
    else:
        r = GroupLimitedRouter(hidden, experts, k, 1, 1, norm, 2.5)
        r.e_score_correction_bias.data = torch.randn(experts) * 0.2
    r.weight.data = torch.randn(experts, hidden)
    if kind == "sparsemixer":  # logits of O(1), not O(sqrt(hidden)): its second weight often sits mid-softmax,
        r.weight.data /= hidden**0.5  # where summation order's 1e-6 of a 30-sized logit would show past 1e-5
    return r


@pytest.mark.parametrize("kind", ["softmax", "sigmoid", "softmax_bias", "topk_softmax", "sparsemixer"])
@pytest.mark.parametrize("norm", [False, True])
def test_native_router_matches_torchs(kind: str, norm: bool) -> None:
    """coli_route against the f32 torch router on bf16 rows: the same experts in the same order (a
    tie within an ulp aside) and weights within float rounding; NaN logits are an error. For the three
    rules: softmax; sigmoid scores picked with a correction bias and weighted without it; softmax
    probabilities picked with a correction bias, weighted without it over max(sum, floor); gpt-oss's softmax
    over the k largest biased logits; Phi-3.5-MoE's sparsemixer."""
    torch.manual_seed(3)
    r = _router(kind, 96, 24, 5, norm)
    x = torch.randn(40, 96).bfloat16()
    idx, w = r(x)  # native (bf16 input)
    ref_idx, ref_w = r(x.float())  # torch (f32 input: the oracle path, same values)
    assert torch.equal(idx, ref_idx)
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="non-finite"):
        r(torch.full((1, 96), float("nan")).bfloat16())
    x[30] = float("nan")  # one bad row among many: the rows are split between threads
    with pytest.raises(RuntimeError, match="non-finite"):
        r(x)
    # A few rows over a router of >= 64 KiB: their logits are split between the threads over (row, expert)
    # (route.c logits_part): the same routes as torch's, and as each row alone.
    big = _router(kind, 1024, 32, 4, norm)
    xs = torch.randn(5, 1024).bfloat16()
    prev = native.get_threads()
    native.set_threads(2)
    try:
        idx, w = big(xs)
        ref_idx, ref_w = big(xs.float())
        assert torch.equal(idx, ref_idx)
        assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
        for t in range(5):
            i1, w1 = big(xs[t : t + 1])
            assert torch.equal(i1[0], idx[t]) and torch.equal(w1[0], w[t])
        xs[2] = float("nan")
        with pytest.raises(RuntimeError, match="non-finite"):
            big(xs)
    finally:
        native.set_threads(prev)


def test_stage_timers_build_and_split_the_step(ckpt) -> None:
    """benchmarks/profile_decode.py --stages: the kernels built with their stage timers (-DCOLI_PROF) time
    every stage of the one-call step, and the stages add up to no more than the step."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_decode.py"), "--model",
                        str(ckpt.coli("olmoe", "int4")), "--stages", "--steps", "8", "--threads", "2"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    stages = dict(re.findall(r"^    (\S.*?)\s+([\d.]+) us", r.stdout, re.M))
    assert set(stages) == set(native.PROF_STAGES) | {"(sum)"}
    step_us = float(re.search(r"step ([\d.]+) ms", r.stdout)[1]) * 1e3
    assert 0 < float(stages["(sum)"]) <= step_us
    assert float(stages["q/k/v"]) > 0 and float(stages["gate_up"]) > 0 and float(stages["attention"]) > 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx512f" not in native._cpu_flags(),
                    reason="an AVX-512 x86 host: the test builds the kernels without it")
def test_kernels_without_avx512_build_load_and_agree() -> None:
    """The kernels as an AVX2/F16C-only CPU gets them (-mno-avx512f): not used by default (their portable
    loops are slower than torch's kernels), but they build and load (F16C's intrinsics were once left
    undeclared there) and, forced, their fallback paths agree with the references of this file's tests."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "COLIBRI_NATIVE_CFLAGS": "-mno-avx512f"}
    # By default such a build is not used (slower than torch's kernels), and says why:
    probe = subprocess.run([sys.executable, "-c", "from colibri.kernels import native; "
                            "print(native.available(), native.why_unavailable())"],
                           capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert probe.stdout.startswith("False") and "AVX-512" in probe.stdout, probe.stdout + probe.stderr
    env["COLIBRI_NATIVE"] = "force"
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                        str(Path(__file__)), "-k",
                        "qlinear_native_matches or fused_moe_layer or decode_attention or rmsnorm_and_rope "
                        "or native_router or wide_rows"], capture_output=True, text=True, timeout=600, cwd=root,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:]
    assert re.search(r"\b\d+ passed", r.stdout) and "skipped" not in r.stdout, r.stdout[-1000:]
