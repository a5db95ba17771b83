"""The dense families (`llama`, `qwen3`, `qwen2`: no MoE layer; the small draft models of speculative decoding)
through the whole engine: transformers' logits and greedy tokens at f32, the tied head, int8 / int4 containers in
the one-call native step (the same bits as the per-layer kernels), batches, the GPU tier's code path, the planner,
`colibri inspect` and the refusals. tests/test_oracle.py and test_prompt_cache.py run them with every family too;
the tier and batch tests, which place and count experts, leave them out (tests/tiny_configs.py DENSE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import converts_dropping, edited_copy, hf_greedy, hf_greedy_with_logits, hf_logits, load_hf
from safetensors import safe_open
from test_batch import PROMPTS, staggered
from test_native_step import _steps
from tiny_configs import DENSE, FAMILIES, tiny_config_kwargs

import colibri
from colibri.analysis.probe import GiB, Machine
from colibri.api import Engine
from colibri.convert.converter import convert
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.format.inspect import main as inspect_main
from colibri.kernels import native
from colibri.layers.moe import SparseMoE
from colibri.models.family import family, supported
from colibri.plan import PlanSizes, plan, report
from colibri.store import Placement

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
N_GREEDY = 40
LOGIT_BOUND = 1e-4  # (tests/test_oracle.py's: f32 both sides, only the summation order differs)
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def test_dense_families_are_registered_and_have_no_experts():
    assert set(DENSE) <= set(supported()) and not set(DENSE) & set(FAMILIES)
    for model_type in DENSE:
        model, _ = family(model_type).build(tiny_config_kwargs(model_type))
        assert not any(isinstance(m, SparseMoE) for m in model.modules()), model_type


@pytest.mark.parametrize("model_type", DENSE)
def test_logits_and_greedy_match_transformers(ckpt, model_type):
    hf = load_hf(ckpt.hf(model_type))
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=128, threads=2) as llm:
        ids = PROMPT * 3  # 36 tokens: past qwen2's tiny sliding window (8, layer 2)
        diff = (llm.logits(ids) - hf_logits(hf, ids)).abs().max().item()
        tokens = list(llm.generate_ids(PROMPT, N_GREEDY, temperature=0, ignore_eos=True))
    print(f"{model_type}: max |logit diff| = {diff:.2e}")
    assert diff < LOGIT_BOUND
    ref_tokens, _ = hf_greedy_with_logits(hf, PROMPT, N_GREEDY)
    assert tokens == ref_tokens
    assert len(set(tokens)) > 1  # a constant sequence would prove little


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_tied_head_is_the_embedding(ckpt, model_type):
    """Llama-3.2-1B and Qwen3-0.6B tie lm_head to the embedding: the checkpoint has no lm_head, the converter stores
    the embedding's rows as the head. (A random tied head repeats its input token greedily: logits only here.)"""
    src = ckpt.hf(model_type, tie_word_embeddings=True)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    path = ckpt.coli(model_type, "f32", tie_word_embeddings=True)
    with colibri.load(path, ctx_size=64, threads=2) as llm:
        got = llm.logits(PROMPT)
    assert (got - hf_logits(load_hf(src), PROMPT)).abs().max().item() < LOGIT_BOUND
    with Container(path) as c:
        assert torch.equal(c.tensor("lm_head.weight"), c.tensor("model.embed_tokens.weight"))


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model_type", DENSE)
def test_quantized_runs_in_one_native_call(ckpt, model_type, scheme):
    """int8 / int4: the decode plan takes the whole step in one native call (a dense model is every layer a dense
    MLP to the kernels), its tokens are the torch backend's, and its logits are as close to f32 as torch's."""
    path, f32 = ckpt.coli(model_type, scheme), ckpt.coli(model_type, "f32")
    with colibri.load(f32, ctx_size=64, threads=2) as llm:
        ref = llm.logits(PROMPT * 3)
    with colibri.load(path, ctx_size=64, threads=2) as llm:
        assert llm.plan.describe().startswith("decode plan: layers 0-2 native (one call a step, with the embedding")
        nat = llm.logits(PROMPT * 3).float()
        tokens = list(llm.generate_ids(PROMPT, 24, temperature=0, ignore_eos=True))
        llm.plan.rebuild(native=False)
        assert list(llm.generate_ids(PROMPT, 24, temperature=0, ignore_eos=True)) == tokens
        tor = llm.logits(PROMPT * 3).float()
        assert llm.metrics()["experts_summed"] == 0
    cosine = F.cosine_similarity(nat, ref, dim=-1).mean().item()
    assert cosine >= F.cosine_similarity(tor, ref, dim=-1).mean().item() - 0.01
    assert cosine > (0.999 if scheme == "int8" else 0.9), cosine
    assert len(set(tokens)) > 1


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model_type", DENSE)
def test_one_call_step_gives_the_per_layer_bits(ckpt, monkeypatch, model_type, scheme):
    """tests/test_native_step.py's check for the dense layers: the whole step in one call (coli_decode_step) and all
    blocks in one call (coli_decode_layers) give the bits of the fused blocks one layer at a time, which give those
    of the kernels called one by one, for one-row steps, a two-sequence step and a prompt chunk."""
    llm = colibri.load(ckpt.coli(model_type, scheme), ctx_size=64, slots=2, threads=2)
    try:
        got = {mode: _steps(llm, mode, monkeypatch) for mode in ("whole", "one_call", "fused", "unfused")}
        assert llm.plan.native_layers() is not None and not llm.plan.native_layers().sparse
    finally:
        llm.close()
    for key in ("rows", "batch", "chunk"):
        assert torch.equal(got["whole"][key], got["fused"][key]), key
        assert torch.equal(got["one_call"][key], got["fused"][key]), key
    assert torch.equal(got["fused"]["rows"], got["unfused"]["rows"])
    assert torch.equal(got["fused"]["batch"], got["unfused"]["batch"])


def test_llama_2s_saved_rope_tables_are_dropped(ckpt, tmp_path):
    """Checkpoints saved by transformers before 4.31 carry `rotary_emb.inv_freq` buffers: dropped, listed, unused."""
    import shutil

    src = shutil.copytree(ckpt.hf("llama"), tmp_path / "old")
    inv = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    converts_dropping(src, lambda _: {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv.clone() for i in range(3)},
                      ckpt.coli("llama", "f32"), tmp_path / "old.coli", PROMPT)


@pytest.mark.parametrize("model_type", DENSE)
def test_batched_requests_get_their_solo_and_transformers_tokens(ckpt, model_type):
    hf = load_hf(ckpt.hf(model_type))
    ref = [hf_greedy(hf, p, 16) for p in PROMPTS]
    with colibri.load(ckpt.coli(model_type, "f32"), ctx_size=64, threads=2, slots=2) as llm:
        assert staggered(llm, PROMPTS, 16) == ref  # requests join at different steps; a slot is reused
    path = ckpt.coli(model_type, "int8")
    with colibri.load(path, ctx_size=64, threads=2, slots=1) as llm:
        solo = [list(llm.generate_ids(p, 16, ignore_eos=True)) for p in PROMPTS]
    with colibri.load(path, ctx_size=64, threads=2, slots=3) as llm:
        assert staggered(llm, PROMPTS, 16) == solo


def test_the_gpu_tiers_code_path(ckpt):
    """Every layer on the GPU tier (its code path on the CPU: gpu_device="cpu"): a dense layer is all dense weights."""
    path = ckpt.coli("qwen3", "f32")
    with colibri.load(path, ctx_size=64, threads=2) as llm:
        ref = list(llm.generate_ids(PROMPT, 16, ignore_eos=True))
    llm = Engine(path, ctx_size=64, threads=2, placement=Placement(["gpu"] * 3), gpu_device="cpu")
    try:
        assert list(llm.generate_ids(PROMPT, 16, ignore_eos=True)) == ref
        assert llm.store_stats()["gpu_dense_bytes"] > 0
    finally:
        llm.close()


def test_the_planner_and_inspect_read_a_dense_container(ckpt, capsys):
    path = ckpt.coli("qwen3", "int8")
    with Container(path) as c:
        sizes = PlanSizes.from_container(c)
    assert sizes.moe_layers == [] and sizes.n_experts == [0, 0, 0] and sizes.one_call
    m = Machine(8 * GiB, 8 * GiB, None, 1e9, 1e10)
    r = plan(sizes, m)
    assert [lp.tier for lp in r.layers] == ["ram"] * 3 and r.cache_bytes == 0 and r.disk_per_token == 0
    assert r.one_call and not r.notes
    assert "layers, dense (no expert); in RAM" in report(sizes, m, None, None, 128)
    small = plan(sizes, m, mem_budget=sizes.dense_bytes // 2)  # (nothing can move to disk)
    assert [lp.tier for lp in small.layers] == ["ram"] * 3
    assert small.notes and "colibri run will refuse it" in small.notes[0]
    with pytest.raises(ColibriError, match="a model without experts keeps them all"):
        Engine(path, ctx_size=16, threads=2, mem_budget=sizes.dense_bytes // 2)
    assert inspect_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "model_type:  qwen3" in out and "records:     0" in out


def test_arch_flag_and_refusals(ckpt, tmp_path):
    src = ckpt.hf("llama")
    with pytest.raises(ColibriError, match="dense checkpoint .*use --arch dense"):
        convert(src, tmp_path / "x.coli", "f32", arch="moe", progress=False)
    assert convert(src, tmp_path / "ok.coli", "int8", 32, arch="dense", progress=False).exists()
    refused = {"llama": ({"mlp_bias": True}, "llama: mlp_bias=True is not supported"),
               "qwen3": ({"layer_types": ["full_attention"] * 2}, "qwen3: layer_types="),
               "qwen2": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
                         "qwen2: rope_scaling.rope_type='dynamic' is not supported")}
    for model_type, (change, message) in refused.items():
        bad = edited_copy(ckpt.hf(model_type), tmp_path / model_type, **change)
        with pytest.raises(ColibriError, match=message.replace("[", r"\[")) as e:
            convert(bad, tmp_path / f"{model_type}.coli", "f32", progress=False)
        assert "\n" not in str(e.value)


def test_windows_follow_transformers_rule():
    """Qwen2 / Qwen3 slide only with use_sliding_window: by layer_types, else from max_window_layers on."""
    args = family("qwen2").args.from_dict
    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
            "vocab_size": 384, "sliding_window": 8, "max_window_layers": 1}
    assert [args(base).window(i) for i in range(3)] == [None] * 3
    on = {**base, "use_sliding_window": True}
    assert [args(on).window(i) for i in range(3)] == [None, 8, 8]
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    assert [args({**on, "layer_types": kinds}).window(i) for i in range(3)] == [8, None, 8]
    assert family("qwen3").args.from_dict(base).head_dim == 128  # (transformers' Qwen3 default, not hidden / heads)
    assert args(base).head_dim == 16
