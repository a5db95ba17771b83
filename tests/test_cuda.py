"""The GPU tier on a real CUDA device: every family's output with its layers on the GPU matches the CPU
engine's (f32: logits within float rounding and the same greedy tokens; int8/int4: bf16 rounding), the VRAM
expert cache gives exactly the all-resident GPU output, batches give their solo tokens, and closing the
engine gives its VRAM back. Skipped without CUDA (CI has none); docs/TIERS.md says where and when it ran.
The rest of the suite tests the CPU engine, also on a GPU machine (conftest.py hides the device)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from test_batch import PROMPTS, staggered
from test_tiers import FAMILIES, N_GREEDY, PROMPT

import colibri
from colibri.api import Engine
from colibri.format.container import Container
from colibri.store import Placement, model_sizes

# COLIBRI_TEST_GPU_DEVICE=cpu dry-runs these tests' own logic on the CPU (the GPU code path, CPU kernels).
DEVICE = os.environ.get("COLIBRI_TEST_GPU_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                   reason="needs a CUDA device")]


def run(path, **kw) -> tuple[list[int], torch.Tensor, dict]:
    llm = Engine(path, ctx_size=128, threads=2, gpu_device=DEVICE, **kw)
    try:
        tokens = list(llm.generate_ids(PROMPT, N_GREEDY, temperature=0, ignore_eos=True))
        logits = llm.logits(PROMPT * 3).float().cpu()  # [T, V]; several tokens per expert
        return tokens, logits, llm.store_stats()
    finally:
        llm.close()


def splits(path) -> dict[str, dict]:
    """All layers in VRAM; GPU / RAM / disk in one model; all on the GPU behind a one-expert VRAM cache."""
    with Container(path) as c:
        s = model_sizes(c)
    n = s.n_layers
    slot = max(s.gpu_expert_bytes[i] for i in s.moe_layers)
    gpu = Placement(["gpu"] * n)
    llm = Engine(path, ctx_size=8, placement=gpu, gpu_device=DEVICE)
    dense = llm.store_stats()["gpu_dense_bytes"]
    llm.close()
    return {"gpu": dict(placement=gpu),
            "gpu-ram-disk": dict(placement=Placement(["gpu"] + ["ram"] * (n - 2) + ["disk"])),
            "gpu-cache-1-slot": dict(placement=gpu, gpu_budget=dense + slot)}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


# The sparse attention's top-k ties (ReLU index scores of exactly 0) break by device: exactness is checked
# with every position kept; the sparse path on the GPU against its own VRAM cache.
DENSE = {"deepseek_v32": {"index_topk": 128}, "glm_moe_dsa": {"index_topk": 128}}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gpu_tier_matches_the_cpu_engine_f32(ckpt, model_type):
    path = ckpt.coli(model_type, "f32", **DENSE.get(model_type, {}))
    n = model_sizes(Container(path)).n_layers
    cpu_tokens, cpu_logits, _ = run(path, placement=Placement(["ram"] * n), mmap=True)
    out = {name: run(path, **kw) for name, kw in splits(path).items()}
    for name, (tokens, logits, stats) in out.items():
        assert rel_err(logits, cpu_logits) < 1e-4, name  # cuBLAS sums in another order: rounding only
        assert tokens == cpu_tokens, name
        assert stats["gpu_dense_bytes"] > 0, name
    assert_cache_is_exact(out)


def assert_cache_is_exact(out: dict) -> None:
    """The VRAM cache refills one slot with every expert in turn: the same bits as all experts resident."""
    assert out["gpu-cache-1-slot"][2]["gpu_cache_slots"] == 1 and out["gpu-cache-1-slot"][2]["misses"] > 0
    assert torch.equal(out["gpu-cache-1-slot"][1], out["gpu"][1])
    assert out["gpu-cache-1-slot"][0] == out["gpu"][0]


@pytest.mark.parametrize("model_type", list(DENSE))
def test_gpu_sparse_attention_runs_on_every_tier(ckpt, model_type):
    path = ckpt.coli(model_type, "f32")
    out = {name: run(path, **kw) for name, kw in splits(path).items()}  # (gpu-ram-disk: a shared layer on the CPU)
    assert_cache_is_exact(out)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_gpu_tier_quantized(ckpt, model_type, scheme):
    """Against the bf16 container (as tests/test_quant_quality.py): the GPU dequantizes to bf16 where the CPU's
    int8 kernel also quantizes activations, so the two differ by more than rounding on these random models;
    the GPU must agree with bf16 about as well as the CPU does (a broken kernel falls to cosine ~0)."""
    over = {"q_lora_rank": 32, "kv_lora_rank": 32} if model_type == "deepseek_v3" else {}
    path, bf16 = ckpt.coli(model_type, scheme, **over), ckpt.coli(model_type, "bf16", **over)
    n = model_sizes(Container(path)).n_layers
    _, ref, _ = run(bf16, placement=Placement(["ram"] * n), mmap=True)

    def quality(logits: torch.Tensor) -> tuple[float, float]:
        cosine = torch.nn.functional.cosine_similarity(logits, ref, dim=-1).mean().item()
        return cosine, (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()

    cpu_cos, cpu_top1 = quality(run(path, placement=Placement(["ram"] * n), mmap=True)[1])
    out = {name: run(path, **kw) for name, kw in splits(path).items()}
    for name, (_, logits, _) in out.items():
        cosine, top1 = quality(logits)
        print(f"{model_type} {scheme} {name}: cosine {cosine:.4f}, top-1 {top1:.1%} (CPU {cpu_cos:.4f}, "
              f"{cpu_top1:.1%})")
        assert cosine >= cpu_cos - 0.01 and top1 >= cpu_top1 - 0.1, name
    assert_cache_is_exact(out)


@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_gpu_batches_give_solo_tokens(ckpt, model_type):
    """Requests joining a GPU decode batch at different steps get their solo tokens (and the CPU's)."""
    path = ckpt.coli(model_type, "f32")
    n = model_sizes(Container(path)).n_layers
    with colibri.load(path, ctx_size=64, threads=2, slots=1, placement=Placement(["ram"] * n)) as cpu:
        ref = [list(cpu.generate_ids(p, 16, ignore_eos=True)) for p in PROMPTS]
    with colibri.load(path, ctx_size=64, threads=2, slots=3, placement=Placement(["gpu"] * n),
                      gpu_device=DEVICE) as llm:
        assert staggered(llm, PROMPTS, 16) == ref
        assert llm.metrics()["experts_unique"] < llm.metrics()["experts_summed"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the planner places layers on CUDA devices only")
def test_the_planner_puts_a_small_model_in_vram_and_close_gives_it_back(ckpt):
    path = ckpt.coli("olmoe", "f32")
    gc.collect()
    before = torch.cuda.memory_allocated()
    llm = Engine(path, ctx_size=128)  # no placement: the planner sees the free VRAM
    stats = llm.store_stats()
    assert stats["placement"].endswith("gpu layers"), stats["placement"]
    assert torch.cuda.memory_allocated() > before
    assert "".join(llm.generate("Once upon a time", 8, temperature=0, ignore_eos=True))
    llm.close()
    del llm
    gc.collect()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)
