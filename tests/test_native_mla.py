"""DeepSeek's MLA attention in one native call (kernels/mla.c, through layers/mla.py `MLAttention.fused`): as
accurate as the torch ops it replaces, each row's bits independent of the other rows of its call, and taken
by every layer of a DeepSeek model's bf16 decode steps without changing what a batch generates."""

from __future__ import annotations

import pytest
import torch

from colibri.kernels import native, native_run
from colibri.layers.batch import LayerKV
from colibri.layers.layers import Linear, RMSNorm
from colibri.layers.mla import MLAArgs, MLAttention
from colibri.quant import QLinear

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")

HIDDEN, S0 = 128, 20  # S0: positions already in the cache before the rows under test
GROUP = 64


def _layer(q_lora: int | None, interleave: bool, scheme: str, bias: bool, dtype: torch.dtype) -> MLAttention:
    """A 4-head MLA layer with quantized projections computing in `dtype` (the same draws for either)."""
    attn = MLAttention(MLAArgs(HIDDEN, 4, q_lora, 64, 32, 16, 32, 10000.0, max_pos=512, rope_interleave=interleave,
                               bias=bias))
    g = torch.Generator().manual_seed(0)
    for name, mod in list(attn.named_children()):
        if isinstance(mod, Linear):
            w = torch.randn(mod.out_features, mod.in_features, generator=g) * mod.in_features**-0.5
            b = (0.1 * torch.randn(mod.out_features, generator=g)).to(dtype) if mod.bias else None
            setattr(attn, name, QLinear.from_dense(w, scheme, GROUP, b, compute_dtype=dtype))
        elif isinstance(mod, RMSNorm):
            mod.weight.data = 1 + 0.1 * torch.randn(mod.weight.shape, generator=g)
    return attn


def _norms() -> tuple[RMSNorm, RMSNorm]:
    g = torch.Generator().manual_seed(1)
    norms = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
    for n in norms:
        n.weight.data = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    return norms


def _history(attn: MLAttention, in_norm: RMSNorm, dtype: torch.dtype, seed: int = 2):
    """A cache holding S0 positions of a random prefix (written by the torch path)."""
    cache = attn.make_cache(64, dtype)
    x = torch.randn(S0, HIDDEN, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        attn(in_norm(x.to(dtype)), LayerKV([(0, S0, 0, cache)], 0))
    return cache


@pytest.mark.parametrize("q_lora", [None, 64], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("interleave", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("scheme,bias", [("int8", False), ("int4", False), ("int8", True)])
def test_mla_block_is_as_accurate_as_torchs(q_lora, interleave, scheme, bias) -> None:
    """Three new rows through the native block against the same quantized layer computed in f32: the block's
    attention output is as close as torch's bf16 ops get (measured 0.90-1.08x torch's error), and the latent it
    writes to the cache is torch's (its rope key within one bf16 step where torch's interleaved RoPE rounds its
    intermediates)."""
    in_norm, post_norm = _norms()
    nat, ref = _layer(q_lora, interleave, scheme, bias, torch.bfloat16), _layer(q_lora, interleave, scheme, bias,
                                                                              torch.float32)
    h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    c_nat, c_tor, c_ref = _history(nat, in_norm, torch.bfloat16), _history(nat, in_norm, torch.bfloat16), \
        _history(ref, in_norm, torch.float32)
    with torch.inference_mode():
        out = nat.fused(h, LayerKV([(0, 3, S0, c_nat)], S0), in_norm, post_norm)
        assert out is not None
        h_out, x_out = out
        tor = h + nat(in_norm(h), LayerKV([(0, 3, S0, c_tor)], S0))  # the torch path, bf16
        exact = h.float() + ref(in_norm(h.float()), LayerKV([(0, 3, S0, c_ref)], S0))
        assert torch.equal(x_out, post_norm(h_out))
    err = lambda y: ((y.float() - exact).norm() / (exact - h.float()).norm()).item()  # noqa: E731
    assert 0 < err(h_out) <= 1.25 * err(tor) + 1e-3, (err(h_out), err(tor))
    R = 64
    assert torch.equal(c_nat.kv[:, :R], c_tor.kv[:, :R])
    rope_diff = (c_nat.kv[:, R:].float() - c_tor.kv[:, R:].float()).abs().max().item()
    assert rope_diff == 0 if not interleave else rope_diff <= 2**-6 * c_tor.kv[:, R:].float().abs().max().item()


@pytest.mark.parametrize("H,W,R", [(20, 96, 64), (5, 80, 64), (16, 288, 256)])
def test_mla_attention_matches_f32_softmax(H, W, R) -> None:
    """coli_mla_attn (heads in groups sharing each pass over the cache; W a multiple of 32 takes the
    vdpbf16ps scores) against softmax(scale q k^T) v in f32, for three rows of different lengths."""
    from colibri.kernels import native_mla

    g = torch.Generator().manual_seed(8)
    S = [1, 37, 300]
    q = torch.randn(3, H, W, generator=g).bfloat16()
    caches = [torch.randn(s + 5, W, generator=g).bfloat16() for s in S]
    got = native_mla.mla_attn(q, caches, S, R, 0.1)
    for t, s in enumerate(S):
        kv = caches[t][:s].float()
        ref = torch.softmax(0.1 * q[t].float() @ kv.T, -1) @ kv[:, :R]  # [H, R]
        assert (got[t].float() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_mla_block_rows_are_independent() -> None:
    """Rows of three sequences in one call, and a prompt chunk's rows, give the bits each row gets alone."""
    in_norm, post_norm = _norms()
    attn = _layer(64, True, "int8", False, torch.bfloat16)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        caches = [_history(attn, in_norm, torch.bfloat16, seed) for seed in (5, 6, 7)]
        starts = [S0, S0 - 7, S0 + 0]
        segs = [(0, 1, starts[0], caches[0]), (1, 2, starts[1], caches[1]), (2, 5, starts[2], caches[2])]
        batch = attn.fused(h, LayerKV(segs, torch.tensor([S0, S0 - 7, S0, S0 + 1, S0 + 2])), in_norm, post_norm)
        alone = []
        for seed, (r0, r1, start, _) in zip((5, 6, 7), segs, strict=True):
            cache = _history(attn, in_norm, torch.bfloat16, seed)
            for r in range(r0, r1):  # one row at a time
                out = attn.fused(h[r : r + 1], LayerKV([(0, 1, start + r - r0, cache)], start + r - r0), in_norm,
                                 post_norm)
                alone.append(out)
    for i in range(2):
        assert torch.equal(batch[i], torch.cat([a[i] for a in alone]))


@pytest.mark.parametrize("model_type,overrides", [
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 32})])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "per-layer"])
def test_deepseek_decode_takes_the_block_and_batches_exactly(ckpt, monkeypatch, model_type, overrides,
                                                             one_call) -> None:
    """Every MLA layer of every bf16 decode step runs the native block -- inside the one-call step (its plan
    holds an MLA block for every layer) or called layer by layer from Python -- and two requests generated
    together get the tokens each gets alone."""
    import colibri
    from colibri.engine import native_step

    if not one_call:
        monkeypatch.setattr(native_step, "build", lambda *a, **k: "asked for torch")
    seen: list[bool] = []
    real = MLAttention.fused

    def spy(self, h, *a):
        r = real(self, h, *a)
        if h.shape[0] <= 2:  # decode steps (a prompt's prefill may take the expanded form)
            seen.append(r is not None)
        return r

    steps: list[int] = []
    for mod, name in ((native_run, "decode_run"), (native, "decode_step")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, **k: steps.append(1) or _fn(*a, **k))
    monkeypatch.setattr(MLAttention, "fused", spy)
    llm = colibri.load(ckpt.coli(model_type, "int8", **overrides), ctx_size=64, slots=2, threads=2)
    try:
        prompts = ["the cat sat", "a longer prompt about routers and experts"]
        alone = ["".join(llm.generate(p, max_tokens=12, temperature=0)) for p in prompts]
        both = llm.generate_batch(prompts, max_tokens=12, temperature=0)
        plan = llm.plan.native_layers() if one_call else None
    finally:
        llm.close()
    if one_call:
        assert steps and plan is not None and all(layer.mla for layer in plan.attn)
    else:
        assert not steps and seen and all(seen)
    assert both == alone
