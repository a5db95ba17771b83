"""Kimi Delta Attention's kernels (kernels/kda.c) for both families that use it: Kimi-Linear's (low-rank gates,
softplus decay) and Ling 3.0's hybrid (full-rank gates, bounded decay). Each against the torch path, in a batch
against each sequence alone, and a prompt's rows in one call against one-row calls."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import top2_margins
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.kernels import native

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
FAMILIES = ("kimi_linear", "bailing_hybrid")  # (three KDA layers of four in both tiny models)
# int4 packs a projection's inputs in blocks of 32: Kimi's gates' low-rank inputs are its KDA head width
INT4 = {"kimi_linear": {"linear_head_dim": 32}, "bailing_hybrid": {}}


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_kda_rows_in_the_kernel_agree_with_the_torch_path(ckpt, monkeypatch, scheme: str, family: str) -> None:
    """bf16 rows, three ways: each KDA layer's decode rows as the whole block in one call (coli_kda_block: in_norm to
    post_norm), from its projections to o_proj's input (coli_kda_rows: the same bits), and in torch; a prompt's rows in
    one coli_kda_rows call a layer. The kernels agree with torch to bf16 rounding (logits, states) and pick the
    same token wherever rounding cannot flip it; every KDA layer of every step took the call asked for."""
    from colibri.kernels import native_kda
    from colibri.layers import kda

    def run(llm, mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rows_taken: list[bool] = []
        block_taken: list[bool] = []
        with monkeypatch.context() as mp:
            if mode == "torch":
                mp.setattr(kda.KimiDeltaAttention, "_native_rows", lambda self, x, kv: False)
            block = kda.KimiDeltaAttention.fused if mode == "block" else (lambda self, *a: None)
            mp.setattr(kda.native_kda, "kda_rows", _spy(native_kda.kda_rows, rows_taken))
            mp.setattr(kda.KimiDeltaAttention, "fused", _spy(block, block_taken))
            logits = prompt_then_decode(llm, PROMPT)
        steps = len(PROMPT) - 4
        if mode == "rows":
            assert len(rows_taken) == 3 * (1 + steps)  # (the prompt's rows in one call a layer, then decode rows)
        elif mode == "block":  # (the prompt's rows decline the block and take the rows kernel)
            assert block_taken == [False] * 3 + [True] * 3 * steps and len(rows_taken) == 3
        return logits, [c.ssm.clone() for c in llm.slots.caches[0] if hasattr(c, "ssm")]

    over = INT4[family] if scheme == "int4" else {}
    with colibri.load(ckpt.coli(family, scheme, **over), ctx_size=64, threads=2) as llm:
        (got, s_got), (ref, s_ref) = run(llm, "rows"), run(llm, "torch")
        block, s_block = run(llm, "block")
    assert torch.equal(block, got) and all(torch.equal(a, b) for a, b in zip(s_block, s_got))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    sure = top2_margins(ref) > 2 * (got - ref).abs().max(-1).values
    assert sure.sum() >= len(PROMPT) // 2 and torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])
    for a, b in zip(s_got, s_ref):
        assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("family", FAMILIES)
def test_kda_rows_in_a_batch_give_each_sequence_its_tokens_alone(ckpt, family: str) -> None:
    """int8 (bf16 rows in kernels/kda.c): three requests with chunked prompts in one batch get the tokens each gets
    alone (a row's arithmetic never depends on its neighbours')."""
    prompts = [PROMPT * 2, PROMPT[:5], PROMPT[3:] * 3]
    path = ckpt.coli(family, "int8")
    with colibri.load(path, ctx_size=96, threads=2, slots=3, prefill_chunk=5) as llm:
        together = [h.wait() for h in [llm.submit(p, 8, ignore_eos=True) for p in prompts]]
    with colibri.load(path, ctx_size=96, threads=2, slots=1) as llm:
        alone = [llm.submit(p, 8, ignore_eos=True).wait() for p in prompts]
    assert together == alone


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompts_rows_in_one_call_are_its_positions_one_by_one(ckpt, family: str) -> None:
    """coli_kda_rows' sequential mode (one state's rows in order inside the call) gives the bits of the same rows in
    one-row calls: outputs and states."""
    from colibri.kernels import native_kda

    with colibri.load(ckpt.coli(family, "int8"), ctx_size=96, threads=2) as llm:
        m = llm.model.model.layers[0].self_attn
        g = torch.Generator().manual_seed(0)
        HD, n = m.a.heads * m.a.head_dim, 20
        q, k, v, f, gate = ((torch.randn(n, HD, generator=g) * 0.5).to(torch.bfloat16) for _ in range(5))
        b = torch.randn(n, m.a.heads, generator=g).to(torch.bfloat16)
        w = m._conv_weight().view(3 * HD, -1)
        a, c = m.make_cache(96, torch.bfloat16), m.make_cache(96, torch.bfloat16)
        whole = native_kda.kda_rows(m, q, k, v, f, b, gate, [a.conv.data_ptr()], [a.ssm.data_ptr()], w, seq=True)
        one = torch.cat([native_kda.kda_rows(m, *(t[i : i + 1] for t in (q, k, v, f, b, gate)), [c.conv.data_ptr()],
                                             [c.ssm.data_ptr()], w) for i in range(n)])
    assert torch.equal(whole, one) and torch.equal(a.ssm, c.ssm) and torch.equal(a.conv, c.conv)
    assert a.ssm.abs().sum() > 0  # (the state moved)
