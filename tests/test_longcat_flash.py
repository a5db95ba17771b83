"""LongCat-Flash (longcat_flash): the variants the tiny model does not take (rows routed only to zero-computation
experts, none of them, biased MLA projections under YaRN) against transformers' logits and greedy tokens; the MoE's
zero experts against their definition; a slot's bytes; the release's names and the zero experts' placeholder weights;
refusals; the decode rows in the kernels. Its oracle, batch, tier, prompt-cache and kernel-accuracy tests run with
every family's (tests/tiny_configs.py: 3 layers, 8 routed + 4 zero experts top-3)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_logits, load_hf, tiny_config_kwargs
from oracle_check import matches_transformers
from test_native_step import _spy, prompt_then_decode

import colibri
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.kernels import native
from colibri.layers.mla import MLAttention
from colibri.models import longcat_flash as lc
from colibri.models.base import build

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _cfg(**over) -> dict:
    return lc.flat_config({"model_type": "longcat_flash", **tiny_config_kwargs("longcat_flash"), **over})


def _hf_routes(hf) -> list[torch.Tensor]:
    """transformers' chosen ids [T, k] of every MoE call of the next forward (hooked on its routers)."""
    seen: list[torch.Tensor] = []
    for layer in hf.model.layers:
        layer.mlp.router.register_forward_hook(lambda m, args, out: seen.append(out[2].clone()))
    return seen


@pytest.mark.parametrize("over", [
    # more zero experts than routed ones: rows whose every pick is a zero expert, others mixing both
    {"n_routed_experts": 4, "zero_expert_num": 12, "moe_topk": 2},
    {"zero_expert_num": 0},  # (none: a plain scaled softmax router with a selection bias)
    {"attention_bias": True, "rope_parameters": YARN, "routed_scaling_factor": 0.7}])
def test_variants_give_transformers_logits(ckpt, over: dict) -> None:
    hf = load_hf(ckpt.hf("longcat_flash", **over))
    routes = _hf_routes(hf)
    hf_logits(hf, PROMPT * 3)  # (the routes of the prompt the oracle compares over)
    n = over.get("n_routed_experts", 8)
    zero = torch.cat([r >= n for r in routes])  # [rows x layers, k]
    if over.get("zero_expert_num", 4):
        assert (zero.any(-1) & ~zero.all(-1)).any()  # (rows mixing both kinds happen)
        assert zero.all(-1).any() == (n == 4)  # (and, with 12 zero experts of 16, rows of zero experts alone)
    else:
        assert not zero.any()
    matches_transformers(ckpt, "longcat_flash", over, PROMPT, hf=hf)


class _Experts(torch.nn.Module):
    """Routed experts as plain matrices (what the MoE module hands rows to): records what it was asked."""

    def __init__(self, n: int, hidden: int):
        super().__init__()
        self.num_experts = n
        self.w = torch.randn(n, hidden, hidden, generator=torch.Generator().manual_seed(1)) / hidden**0.5
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x, idx, weights, resid=None):
        self.calls.append((idx, weights))
        return torch.einsum("tk,tkh->th", weights, torch.einsum("th,tkoh->tko", x, self.w[idx]))


def test_zero_experts_return_their_input_times_their_weight() -> None:
    """y = sum over real picks of w e(x) + sum over zero picks of w x; zero slots reach the experts as a repeat of
    the row's first real expert (the step's first for a row with none) at weight 0."""
    n, H = 3, 8
    gate = lambda x: (torch.tensor([[0, 4, 2], [5, 3, 4], [3, 1, 1]]),  # noqa: E731
                      torch.tensor([[0.5, 0.25, 1.5], [2.0, 0.75, 0.125], [1.0, 0.5, 0.25]]))
    moe = lc.ZeroExpertMoE(gate, _Experts(n, H))
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    got = moe(x)
    e = moe.experts.w
    want = torch.stack([0.5 * e[0] @ x[0] + 0.25 * x[0] + 1.5 * e[2] @ x[0],
                        2.0 * x[1] + 0.75 * x[1] + 0.125 * x[1],
                        1.0 * x[2] + 0.5 * e[1] @ x[2] + 0.25 * e[1] @ x[2]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    idx, weights = moe.experts.calls[0]
    assert idx.tolist() == [[0, 0, 2], [0, 0, 0], [1, 1, 1]]
    assert weights.tolist() == [[0.5, 0.0, 1.5], [0.0, 0.0, 0.0], [0.0, 0.5, 0.25]]


def test_a_slot_counts_both_latent_caches() -> None:
    """Two MLA latents a layer and position (kv_lora_rank + qk_rope_head_dim each), nothing fixed."""
    model, _ = build("longcat_flash", _cfg())
    per_pos, fixed = model.cache_cost(torch.bfloat16)
    assert (per_pos, fixed) == (3 * 2 * (16 + 8) * 2, 0)


def test_release_names_map_to_the_canonical_ones() -> None:
    pairs = {"model.layers.0.input_layernorm.0.weight": "model.layers.0.input_layernorm.weight",
             "model.layers.0.input_layernorm.1.weight": "model.layers.0.input_layernorm_1.weight",
             "model.layers.2.post_attention_layernorm.0.weight": "model.layers.2.post_attention_layernorm.weight",
             "model.layers.2.post_attention_layernorm.1.weight": "model.layers.2.post_attention_layernorm_1.weight",
             "model.layers.1.mlp.router.classifier.weight": "model.layers.1.mlp.gate.weight",
             "model.layers.1.mlp.router.e_score_correction_bias": "model.layers.1.mlp.gate.e_score_correction_bias",
             "model.layers.1.mlp.experts.7.down_proj.weight": "model.layers.1.mlp.experts.7.down_proj.weight",
             "model.layers.0.self_attn.1.q_b_proj.weight": "model.layers.0.self_attn.1.q_b_proj.weight",
             "model.layers.0.mlps.1.up_proj.weight": "model.layers.0.mlps.1.up_proj.weight",
             "model.norm.weight": "model.norm.weight"}
    assert {k: lc.sanitize(k) for k in pairs} == pairs
    # the MTP module's (vLLM's longcat_flash_mtp.py names; tests/test_spec_mtp.py runs one)
    mtp = {"model.mtp.layers.0.self_attn.q_a_proj.weight": "mtp.0.block.self_attn.q_a_proj.weight",
           "model.mtp.layers.0.transformer_layer.mlp.down_proj.weight": "mtp.0.block.mlp.down_proj.weight",
           "model.mtp.layers.0.enorm.m.weight": "mtp.0.enorm.weight", "model.mtp.norm.weight": "mtp.0.norm.weight",
           "model.mtp.layers.0.eh_proj.weight": "mtp.0.eh_proj.weight", "model.mtp.embed_tokens.weight": None}
    assert {k: lc.sanitize(k) for k in mtp} == mtp


@pytest.mark.parametrize("fused", [False, True])
def test_the_zero_experts_placeholders_are_not_converted(ckpt, fused: bool) -> None:
    """transformers saves gate/up weights for the zero experts (per expert, or fused rows past the routed ones);
    the container holds the routed experts only, and the LoRA scales are in q_b_proj / kv_a_layernorm."""
    import safetensors

    hf_dir = ckpt.hf("longcat_flash", fused=fused)
    with safetensors.safe_open(hf_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
        if fused:
            assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()[0] == 8 + 4
        else:
            assert "model.layers.0.mlp.experts.11.gate_proj.weight" in names
        q_b = f.get_tensor("model.layers.1.self_attn.0.q_b_proj.weight")
        kv_norm = f.get_tensor("model.layers.1.self_attn.1.kv_a_layernorm.weight")
    with Container(ckpt.coli("longcat_flash", "f32", fused=fused)) as c:
        assert c.has_record("model.layers.0.mlp.experts.7") and not c.has_record("model.layers.0.mlp.experts.8")
        torch.testing.assert_close(c.tensor("model.layers.1.self_attn.0.q_b_proj.weight"),
                                   q_b * (64 / 24) ** 0.5, rtol=1e-6, atol=0)
        torch.testing.assert_close(c.tensor("model.layers.1.self_attn.1.kv_a_layernorm.weight"),
                                   kv_norm * (64 / 16) ** 0.5, rtol=1e-6, atol=0)


@pytest.mark.parametrize("over,field", [
    ({"router_bias": True}, "router_bias"),
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"zero_expert_type": "zero"}, "zero_expert_type"),
    ({"attention_method": "MHA"}, "attention_method"),
    ({"mla_scale_q_lora": False}, "mla_scale_q_lora"),
    ({"mla_scale_kv_lora": False}, "mla_scale_kv_lora"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"head_dim": 16}, "head_dim"),
    ({"qk_head_dim": 20}, "qk_head_dim"),
    ({"n_routed_experts": 0}, "n_routed_experts"),
    ({"moe_topk": 13}, "moe_topk"),
    ({"hidden_act": "gelu"}, "hidden_act")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    lc.check_config(_cfg())  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        lc.check_config(_cfg(**over))


def test_num_layers_counts_colibris_layers() -> None:
    """transformers' num_hidden_layers is twice LongCat's `num_layers` (its attention sublayers); colibri's layers
    are LongCat's."""
    cfg = _cfg()
    assert cfg["num_hidden_layers"] == 3
    model, args = build("longcat_flash", cfg)
    assert len(model.model.layers) == 3 and args.num_hidden_layers == 3


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme,over", [("int8", {}), ("int4", {"q_lora_rank": 32, "kv_lora_rank": 32})])
def test_decode_rows_in_the_kernels_agree_with_the_torch_path(ckpt, monkeypatch, scheme: str, over: dict) -> None:
    """bf16 decode rows: both MLA sublayers of every layer in kernels/mla.c's block (the spy counts them), the
    dense MLPs and the experts in the kernels; against the same model in torch (MLA unfused, experts and MLPs in torch
    ops) to bf16 rounding, with the same top token at every step."""
    from colibri.layers import moe, native_mlp

    def logits(llm, native_path: bool) -> torch.Tensor:
        taken: list[bool] = []
        with monkeypatch.context() as mp:
            if native_path:
                mp.setattr(MLAttention, "fused", _spy(MLAttention.fused, taken))
            else:
                mp.setattr(MLAttention, "fused", lambda *a: None)
                mp.setattr(native_mlp, "run", lambda *a, **k: None)
                mp.setattr(moe.native, "MOE_MAX_ROWS", 0)
            logits = prompt_then_decode(llm, PROMPT)
        if native_path:
            assert taken == [True] * (2 * 3 * (len(PROMPT) - 3))  # (the prompt's 4 rows take it too)
        return logits

    with colibri.load(ckpt.coli("longcat_flash", scheme, **over), ctx_size=64, threads=2) as llm:
        got, ref = logits(llm, True), logits(llm, False)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("scheme,over", [("int8", {}), ("int4", {"q_lora_rank": 32, "kv_lora_rank": 32}),
                                         ("int8", {"zero_expert_num": 8, "num_experts_per_tok": 4})])  # (mixed)
def test_the_moe_in_one_call_gives_the_bits_of_the_torch_glue(ckpt, monkeypatch, scheme: str, over: dict) -> None:
    """bf16 rows of a resident layer: the MoE in one kernels/moe.c call (coli_zero_moe: router, zero slots, experts,
    identity term) gives exactly the logits of the router and the experts called apart with the zero slots in torch
    between them; the call took every MoE layer of every step, and zero slots were among its routes."""
    from colibri.kernels import native_zero

    calls: list[tuple] = []

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        return out

    def run(llm, native_path: bool) -> tuple[torch.Tensor, list]:
        routes: list = []
        with monkeypatch.context() as mp:
            mp.setattr(native_zero, "zero_moe", spy)
            if not native_path:
                mp.setattr(lc.ZeroExpertMoE, "native", lambda self, x, resid: None)
            return prompt_then_decode(llm, PROMPT, routes=routes), routes  # (what the routing log and trace receive)

    real = native_zero.zero_moe
    with colibri.load(ckpt.coli("longcat_flash", scheme, **over), ctx_size=64, threads=2) as llm:
        got, got_routes = run(llm, True)
        n = len(calls)
        ref, ref_routes = run(llm, False)
    assert n == len(calls) == 3 * (len(PROMPT) - 3) and all(c is not None for c in calls)
    assert any(bool((c[2] == 0).any()) for c in calls)  # (zero slots: weight-0 repeats of a real expert)
    assert torch.equal(got, ref) and got_routes == ref_routes and len(got_routes) == n


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_the_routers_native_rule_is_its_torch_rule() -> None:
    """bf16 rows: the kernels' softmax-with-bias rule without renormalising (times the scale) picks the experts and
    weights the router's torch rule picks (f32 rows take torch's)."""
    args = lc.ModelArgs.from_dict(_cfg(hidden_size=32, n_routed_experts=24, zero_expert_num=8, moe_topk=5,
                                       routed_scaling_factor=3.0))
    router = lc.Router(args)
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(32, 32, generator=g)
    router.e_score_correction_bias.data = torch.rand(32, generator=g) * 0.05
    x = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    assert router.native_routing() is not None
    idx, w = router(x)
    want_idx, want_w = router(x.float())  # (the torch rule: the same bf16 values, in f32)
    assert torch.equal(idx.sort(-1).values, want_idx.sort(-1).values)
    torch.testing.assert_close(w.gather(1, idx.argsort(-1)), want_w.gather(1, want_idx.argsort(-1)))
