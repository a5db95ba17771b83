"""Multi-head Latent Attention: YaRN against transformers, absorbed == expanded, the latent cache,
and the DeepSeek families against transformers with YaRN rope scaling."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_greedy_with_logits, hf_logits, load_hf, make_tiny_checkpoint
from transformers import DeepseekV2Config, DeepseekV3Config, DynamicCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

import colibri
from colibri.convert.converter import convert
from colibri.layers.batch import StepBatch
from colibri.layers.layers import Linear, rope_inv_freq, rope_scaling, rope_theta
from colibri.layers.mla import LatentCache, MLAArgs, MLAttention
from colibri.layers.moe import SwitchGLU
from colibri.quant import QLinear

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
LOGIT_BOUND = 1e-4  # as tests/test_oracle.py

YARN_CASES = {  # rope_parameters beyond rope_type/theta; max_position_embeddings
    "v3-real": ({"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                 "original_max_position_embeddings": 4096}, 163840),
    "v2-real": ({"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                 "original_max_position_embeddings": 4096}, 163840),
    "mscale-ratio": ({"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                      "original_max_position_embeddings": 64}, 256),
    "no-truncate": ({"factor": 4.0, "truncate": False, "original_max_position_embeddings": 64}, 256),
    "factor-from-lengths": ({"factor": None, "original_max_position_embeddings": 64}, 256),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_inv_freq_and_attention_factor_match_transformers(case):
    params, max_pos = YARN_CASES[case]
    cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=max_pos,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params})
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    raw = cfg.to_dict()
    inv, factor = rope_inv_freq(64, rope_theta(raw), rope_scaling(raw), max_pos)
    assert torch.equal(inv, ref_inv)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.parametrize("params", [None, YARN_CASES["v2-real"][0], YARN_CASES["mscale-ratio"][0]],
                         ids=["plain", "yarn-v2", "yarn-ratio"])
def test_softmax_scale_matches_transformers(params):
    rope = {"rope_type": "default", "rope_theta": 10000.0} if params is None else \
        {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_parameters=rope,
                           max_position_embeddings=163840)
    raw = cfg.to_dict()
    ours = MLAttention(MLAArgs(64, 4, None, 16, 16, 8, 16, rope_theta(raw), rope_scaling(raw), 163840))
    assert ours.scale == pytest.approx(DeepseekV3Attention(cfg, 0).scaling, rel=1e-12)
    if params is not None:  # mscale_all_dim really changes it: 1/sqrt(24) * (0.1 m ln f + 1)^2
        assert ours.scale > 24**-0.5 * 1.01


def _random_mla(q_lora: int | None, interleave: bool, kv_b_scheme: str = "f32", seed: int = 0) -> MLAttention:
    a = MLAArgs(hidden=48, heads=4, q_lora_rank=q_lora, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12, rope_theta=1e4, max_pos=128, rope_interleave=interleave)
    m = MLAttention(a)
    gen = torch.Generator().manual_seed(seed)
    for name, mod in list(m.named_children()):
        if isinstance(mod, Linear):
            w = torch.randn(mod.out_features, mod.in_features, generator=gen) * 0.3
            scheme = kv_b_scheme if name == "kv_b_proj" else "f32"
            setattr(m, name, QLinear.from_dense(w, scheme, compute_dtype=torch.float32))
    for norm in (m.kv_a_layernorm, getattr(m, "q_a_layernorm", None)):
        if norm is not None:
            norm.weight.data = 1 + 0.2 * torch.randn(norm.weight.shape, generator=gen)
    return m


def _run(m: MLAttention, mode: str, x: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, LatentCache]:
    """Feed x [T, hidden] in chunks (prefill, chunked prefill, then single-token decode steps)."""
    m.mode = mode
    cache = m.make_cache(64, torch.float32)
    outs, start = [], 0
    for n in chunks:
        outs.append(m(x[start : start + n], StepBatch.single([cache], start, n).layer(0)))
        start += n
    return torch.cat(outs), cache


@pytest.mark.parametrize("q_lora", [None, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("kv_b_scheme", ["f32", "int8"])
def test_absorbed_equals_expanded(q_lora, interleave, kv_b_scheme):
    m = _random_mla(q_lora, interleave, kv_b_scheme)
    x = torch.randn(24, 48, generator=torch.Generator().manual_seed(1))
    chunks = [9, 6, 1, 1, 1, 3, 1, 1, 1]  # prefill, a chunk at start > 0, decode steps
    ref, ref_cache = _run(m, "expanded", x, [24])  # one causal prefill: the plainest computation
    for mode in ("expanded", "absorbed", "auto"):
        out, cache = _run(m, mode, x, chunks)
        scale = ref.abs().max().item()
        assert (out - ref).abs().max().item() < 1e-5 * scale, mode
        # same latents (up to GEMM blocking: rows computed in different chunk sizes)
        torch.testing.assert_close(cache.kv[:24], ref_cache.kv[:24], rtol=1e-6, atol=1e-6)


def test_auto_picks_absorbed_for_decode_and_expanded_for_long_prefill():
    # V2-Lite shapes: decode over any context is absorbed; a long prefill from scratch is expanded.
    m = MLAttention(MLAArgs(2048, 16, None, 512, 128, 64, 128, 10000.0))
    assert m._use_absorbed(1, 2) and m._use_absorbed(1, 4096)
    assert not m._use_absorbed(2048, 2048)


def test_latent_cache_size_and_contents_match_transformers(ckpt):
    """The cache holds [kv_a_layernorm(c), rope(k_pe)] per token: exactly transformers' latent cache."""
    for model_type in ("deepseek_v2", "deepseek_v3"):
        hf = load_hf(ckpt.hf(model_type))
        llm = colibri.load(ckpt.coli(model_type, "f32"), ctx_size=64, threads=2)
        cfg = hf.config
        R, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            hf(input_ids=torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
        llm.logits(PROMPT)
        # transformers' V3 interleaved rope returns (even-pair outputs, odd-pair outputs); ours keeps pairs
        perm = torch.cat((torch.arange(0, Dr, 2), torch.arange(1, Dr, 2))) \
            if model_type == "deepseek_v3" else torch.arange(Dr)
        for layer, ours in zip(cache.layers, llm.caches):
            assert isinstance(ours, LatentCache) and ours.kv.shape == (64, R + Dr)
            assert ours.nbytes == 64 * (R + Dr) * 4  # vs 64 * heads * (Dn + Dr + Dv) * 4 expanded
            got = ours.kv[: len(PROMPT)]
            torch.testing.assert_close(got[:, :R], layer.keys[0, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[:, R:][:, perm], layer.values[0, 0], rtol=1e-5, atol=1e-5)
        assert llm.kv_bytes() == cfg.num_hidden_layers * 64 * (R + Dr) * 4


YARN_ROPE = {  # tiny contexts so transformers finds the factor consistent with max_position_embeddings
    "deepseek_v2": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 64},
    "deepseek_v3": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                    "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 64},
}


@pytest.fixture(scope="module")
def yarn_ckpt(tmp_path_factory):
    # (conftest's `ckpt` keys its cache on hashable overrides; a rope dict is not hashable)
    built = {}

    def get(model_type: str):
        if model_type not in built:
            root = tmp_path_factory.mktemp(f"{model_type}_yarn")
            src = make_tiny_checkpoint(model_type, root / "hf", rope_parameters=YARN_ROPE[model_type])
            built[model_type] = (src, convert(src, root / "m.coli", "f32", progress=False))
        return built[model_type]

    return get


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_yarn_checkpoint_matches_transformers(yarn_ckpt, model_type):
    src, coli = yarn_ckpt(model_type)
    hf = load_hf(src)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    llm = colibri.load(coli, ctx_size=128, threads=2)
    attn = llm.model.model.layers[0].self_attn
    # Both knobs are live: cos/sin scaled when mscale != mscale_all_dim (v3 case), softmax scale always.
    assert (attn.rope.mscale != 1.0) == (model_type == "deepseek_v3")
    assert attn.scale > 1.01 * (attn.a.qk_nope_head_dim + attn.a.qk_rope_head_dim) ** -0.5
    ids = PROMPT * 3
    diff = (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item()
    print(f"{model_type} yarn: max |logit diff| = {diff:.4e}")
    assert diff < LOGIT_BOUND
    ref_tokens, _ = hf_greedy_with_logits(hf, PROMPT, 40)
    assert list(llm.generate_ids(PROMPT, 40, temperature=0, ignore_eos=True)) == ref_tokens


def test_v2_config_ignores_rope_interleave():
    # V2 always rotates complex pairs (transformers' V2 has no rope_interleave switch).
    from colibri.models.deepseek_v2 import ModelArgs

    cfg = DeepseekV2Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None).to_dict()
    assert ModelArgs.from_dict({**cfg, "rope_interleave": False}).mla().rope_interleave is True


VARIANTS = [  # paths the default tiny configs leave out (all hashable overrides, so `ckpt` caches them)
    ("deepseek_v3", {"attention_bias": True, "rope_interleave": False}),
    ("deepseek_v2", {"q_lora_rank": 24, "topk_method": "greedy", "first_k_dense_replace": 0}),
]


@pytest.mark.parametrize("model_type,overrides", VARIANTS, ids=["v3-bias-halves", "v2-qlora-greedy"])
def test_variant_matches_transformers(ckpt, model_type, overrides):
    hf = load_hf(ckpt.hf(model_type, **overrides))
    llm = colibri.load(ckpt.coli(model_type, "f32", **overrides), ctx_size=128, threads=2)
    ids = PROMPT * 3
    diff = (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item()
    print(f"{model_type} {overrides}: max |logit diff| = {diff:.4e}")
    assert diff < LOGIT_BOUND
    ref_tokens, _ = hf_greedy_with_logits(hf, PROMPT, 40)
    assert list(llm.generate_ids(PROMPT, 40, temperature=0, ignore_eos=True)) == ref_tokens



# q_lora_rank 32 for v3: torch's fused int8 CPU kernel returns garbage (or crashes) for an input
# width that is not a multiple of 16, and the tiny config's 24 is one (reported against quant.py).
@pytest.mark.parametrize("model_type,overrides", [("deepseek_v2", {}), ("deepseek_v3", {"q_lora_rank": 32})],
                         ids=["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_container_computes_what_its_weights_say(ckpt, model_type, overrides, scheme):
    """f32 compute over an int8/int4 container == transformers run on the dequantized weights.

    Checks the quantized paths (kv_b_proj dequantized once for the absorbed form, QLinear for the
    rest) exactly, where a bf16-vs-int8 agreement floor could only check them loosely. The
    bound is the oracle's noise level: measured 0.5-1.3e-4 (int8 rescales after the matmul).
    """
    hf = load_hf(ckpt.hf(model_type, **overrides))
    llm = colibri.load(ckpt.coli(model_type, scheme, **overrides), ctx_size=64, threads=2, dtype=torch.float32)
    state = hf.state_dict()
    with torch.no_grad():
        for name, mod in llm.model.named_modules():
            if isinstance(mod, QLinear):
                state[f"{name}.weight"].copy_(mod.dequantized_weight())
            elif isinstance(mod, SwitchGLU):
                for e, w in mod.source.fetch(mod.layer, list(range(mod.num_experts))):
                    state[f"{name}.gate_up_proj"][e].copy_(w.gate_up.dequantized_weight())
                    state[f"{name}.down_proj"][e].copy_(w.down.dequantized_weight())
        state["model.embed_tokens.weight"].copy_(llm.model.model.embed_tokens.weight.float())
    ids = PROMPT * 3
    diff = (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item()
    print(f"{model_type} {scheme}: max |logit diff| vs transformers on dequantized weights = {diff:.2e}")
    assert diff < 2 * LOGIT_BOUND
