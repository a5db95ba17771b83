"""MiniMax-Text-01 / M1 (minimax): the variants the tiny model does not take (lightning layers first and in a row with
prompts across blocks and a tail, weighted residuals with betas other than 1, transformers' default layer list)
against transformers' logits and greedy tokens; lightning attention's blocked form against its recurrence; the decay
rates against transformers'; a slot's bytes; the decay tables dropped at conversion; refusals; the MoE block in the
kernels. Chunked prompts, batches and caching off: tests/test_state_models.py. Its oracle, batch, tier and
kernel-accuracy tests run with every family's (tests/tiny_configs.py)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.kernels import native
from colibri.layers.lightning import lightning, slope_rate
from colibri.layers.moe import SparseMoE
from colibri.models import minimax
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def _cfg(**over) -> dict:
    return {"model_type": "minimax", **tiny_config_kwargs("minimax"), **over}


@pytest.mark.parametrize("over", [
    # lightning layers first and twice in a row, blocks of 5 (36 prompt positions: 7 blocks and a tail), betas != 1
    {"num_hidden_layers": 4, "block_size": 5, "full_attn_beta_factor": 0.8, "linear_attn_beta_factor": 1.25,
     "mlp_beta_factor": 0.7, "layer_types": ["linear_attention", "linear_attention", "full_attention",
                                             "linear_attention"]},
    {"layer_types": None}])  # (transformers' default: full attention in the even layers)
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    matches_transformers(ckpt, "minimax", over, PROMPT)


@pytest.mark.parametrize("T,block", [(1, 4), (7, 3), (12, 4), (9, 16)])
def test_blocks_continue_a_state_as_the_recurrence(T: int, block: int) -> None:
    """The blocked form from a non-zero state = the recurrence S <- exp(-s) S + k^T v, o = q S (f32)."""
    g = torch.Generator().manual_seed(0)
    H, D = 3, 8
    q, k, v = (torch.randn(H, T, D, generator=g) for _ in range(3))
    slope = slope_rate(H, 1, 4)
    S0 = torch.randn(H, D, D, generator=g)
    S, want = S0.clone(), []
    for t in range(T):
        S = torch.exp(-slope) * S + k[:, t : t + 1].transpose(1, 2) @ v[:, t : t + 1]
        want.append(q[:, t : t + 1] @ S)
    S_got = S0.clone()
    got = lightning(q, k, v, S_got, slope, block)
    torch.testing.assert_close(got, torch.cat(want, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_got, S, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 2, 5])
def test_decay_rates_are_transformers(layer: int) -> None:
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = MiniMaxConfig(hidden_size=64, num_attention_heads=8, num_hidden_layers=6, block_size=4,
                        layer_types=["linear_attention"] * 6)
    assert torch.equal(slope_rate(8, layer, 6), MiniMaxLightningAttention(cfg, layer).slope_rate)


def test_a_slot_counts_kv_and_states() -> None:
    """K/V per position for the full attention layer, a fixed f32 state [H, D, D] for each lightning layer."""
    model, _ = build("minimax", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert per_pos == 2 * 2 * 16 * 2  # one full layer: K and V of 2 kv heads of 16, bf16
    assert fixed == 2 * 4 * 16 * 16 * 4  # two lightning layers: 4 heads' [16, 16] f32


def test_the_decay_tables_are_dropped_and_rebuilt(ckpt) -> None:
    """transformers saves each lightning layer's decay tables; the container holds none of them (meta lists them as
    dropped) and the model computes the same rates."""
    import safetensors

    with safetensors.safe_open(ckpt.hf("minimax") / "model.safetensors", "pt") as f:
        saved = f.get_tensor("model.layers.0.self_attn.slope_rate")
    with Container(ckpt.coli("minimax", "f32")) as c:
        assert not any("decay" in n or "slope" in n for n in c.names())
        assert "model.layers.0.self_attn.diagonal_decay" in c.meta["converter"]["dropped"]
    with colibri.load(ckpt.coli("minimax", "f32"), ctx_size=16, threads=2) as llm:
        assert torch.equal(llm.model.model.layers[0].self_attn.slope, saved)


@pytest.mark.parametrize("over,field", [
    ({"layer_types": ["linear_attention", "mamba", "full_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention"]}, "layer_types"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"block_size": 0}, "block_size"),
    ({"mlp_alpha_factor": "1"}, "mlp_alpha_factor"),
    ({"postnorm": False}, "postnorm"),
    ({"rotary_dim": 8}, "rotary_dim"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    minimax.check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        minimax.check_config(_cfg(**over))


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_decode_rows_run_in_the_kernels(ckpt, monkeypatch, scheme: str) -> None:
    """bf16 decode rows: each lightning layer's mixing half in kernels/lightning.c (in_norm to post_norm, the weighted
    residual between) and each MoE layer in kernels/moe.c's block with alpha x as its residual (the spies count every
    layer of every decode step; the prompt's rows take the blocked form in torch), against the torch path (lightning in
    torch ops, the experts in torch ops) to bf16 rounding, with the same top token at every step."""
    from colibri.layers import moe
    from colibri.layers.lightning import LightningAttention

    def logits(llm, native_path: bool) -> torch.Tensor:
        taken: list[bool] = []
        mixed: list[bool] = []
        with monkeypatch.context() as mp:
            if native_path:
                mp.setattr(SparseMoE, "fused", _spy(SparseMoE.fused, taken))
                mp.setattr(LightningAttention, "fused", _spy(LightningAttention.fused, mixed))
            else:
                mp.setattr(LightningAttention, "fused", lambda *a: None)
                mp.setattr(moe.native, "MOE_MAX_ROWS", 0)
            logits = prompt_then_decode(llm, PROMPT)
        if native_path:
            assert taken == [True] * (3 * (len(PROMPT) - 3))  # (the prompt's 4 rows take it too)
            assert mixed == [False] * 2 + [True] * (2 * (len(PROMPT) - 4))  # (two lightning layers)
        return logits

    with colibri.load(ckpt.coli("minimax", scheme), ctx_size=64, threads=2) as llm:
        got, ref = logits(llm, True), logits(llm, False)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
