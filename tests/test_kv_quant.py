"""The KV cache in 8 and 4 bits (-ctk / -ctv, `kv_type=`): the storage's numerics, the engine with a quantized cache
on the torch and native paths, prompt caching and prompt cache files carrying the quantized rows, memory counted
in quantized bytes, and one-line refusals. The default cache's bits are the oracle tests' (unchanged)."""

from __future__ import annotations

import pytest
import torch

import colibri
from colibri.errors import ColibriError
from colibri.kernels import native
from colibri.layers.kvquant import KVType, KVTypes, dequantize, quantize, row_bytes

# head_dim 32 (the tiny configs' 16 is narrower than one block of 32)
WIDE = {"num_attention_heads": 2, "num_key_value_heads": 2}
WIDE_HEADS = {"olmoe": WIDE, "qwen3_moe": {"head_dim": 32}, "gpt_oss": {"head_dim": 32}}
PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3, 77, 31]
N = 10


def greedy(llm, prompt=PROMPT, n=N, **kw) -> list[int]:
    return llm.submit(prompt, n, ignore_eos=True, **kw).wait()


@pytest.mark.parametrize("t", [KVType.Q8_0, KVType.Q4_0])
def test_rows_round_trip_within_half_a_step(t):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 2, 64)  # blocks of very different scales
    x[0, 0, :32] = 0  # an all-zero block: scale 0, codes 0 (8 for q4_0), values 0
    rows = quantize(x, t)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 5, row_bytes(t, 64))
    y = dequantize(rows, t, 64, torch.float32)
    assert torch.equal(y[0, 0, :32], torch.zeros(32))
    d = rows.reshape(-1, rows.shape[-1])[:, :4].contiguous().view(torch.float16).float().abs()  # [R, 2] scales
    err = (y - x).abs().reshape(-1, 2, 32).amax(-1)  # [R, 2]
    # rounding to the nearest code: within half a step (q4_0: a whole one where a value of the extreme's opposite
    # sign would need code 16), plus the f16 scale's own rounding
    half = 0.5 if t == KVType.Q8_0 else 1.0
    assert bool((err <= d * half + x.abs().reshape(-1, 2, 32).amax(-1) * 2**-10).all())
    if t == KVType.Q4_0:  # the block's extreme value is exact (its code is 0: -8 steps of a negative scale)
        xb = x.reshape(-1, 2, 32)
        i = xb.abs().argmax(-1, keepdim=True)
        assert torch.equal(y.reshape(-1, 2, 32).gather(-1, i), xb.gather(-1, i).half().float())


def test_type_names_and_codes():
    from colibri.cli.kvflags import KV_TYPES
    from colibri.layers.kvquant import NAMES

    assert KV_TYPES == NAMES  # (the CLI's copy, kept free of torch)
    assert KVTypes.of(None) == KVTypes() and not KVTypes().quantized
    assert KVTypes.of("q8_0") == KVTypes(KVType.Q8_0, KVType.Q8_0)
    kv = KVTypes.of(("q4_0", "bf16"))
    assert kv.quantized and kv.code == 2 and str(kv) == "K q4_0, V bf16"
    with pytest.raises(ColibriError, match="unknown KV cache type 'q5_1'"):
        KVTypes.of("q5_1")


@pytest.mark.parametrize("model_type", ["olmoe", "qwen3_moe", "gpt_oss"])
def test_f32_with_a_quantized_cache_stays_close_and_the_default_keeps_its_bits(ckpt, model_type):
    """The torch path (f32) over q8_0 / q4_0 rows: prompt logits near the exact cache's, q8_0 nearer than q4_0;
    greedy decoding from q8_0 mostly agrees on these random models (their margins are small)."""
    path = ckpt.coli(model_type, "f32", **WIDE_HEADS[model_type])
    logits, toks = {}, {}
    for kv in ("bf16", "q8_0", "q4_0"):
        with colibri.load(path, ctx_size=64, threads=2, kv_type=kv) as llm:
            logits[kv], toks[kv] = llm.logits(PROMPT), greedy(llm)
    with colibri.load(path, ctx_size=64, threads=2) as llm:  # the default: exactly the bf16-named cache's bits
        assert torch.equal(llm.logits(PROMPT), logits["bf16"]) and greedy(llm) == toks["bf16"]
    # Random tiny models amplify any error through their layers (logits' std ~12 here): measured medians over the
    # prompt's positions of the largest logit error / that std were 0.04-0.06 (q8_0) and 0.8-1.0 (q4_0)
    spread = logits["bf16"].std()
    e8, e4 = ((logits[kv] - logits["bf16"]).abs().amax(-1).median() / spread for kv in ("q8_0", "q4_0"))
    assert e8 < 0.15 and e4 < 2.0 and e8 * 4 < e4, (e8, e4)


needs_native = pytest.mark.skipif(not native.available(), reason="native kernels not built")


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_native_and_torch_paths_agree_on_a_quantized_cache(ckpt, scheme):
    """bf16 decode through the plan's native backend (one call a step) and through the modules' own forward over the
    same q8_0 cache: the same greedy tokens, logits within bf16 rounding."""
    path = ckpt.coli("olmoe", scheme, **WIDE)
    out = {}
    for native_plan in (True, False):
        with colibri.load(path, ctx_size=64, threads=2, kv_type="q8_0") as llm:
            llm.plan.rebuild(native=native_plan)
            out[native_plan] = greedy(llm, n=16)
    assert out[True] == out[False]


@needs_native
def test_batches_and_prompt_caching_keep_the_quantized_bits(ckpt):
    """Batching and prompt caching may change speed, never output: a request alone, in a batch with a staggered
    second one, and resumed from a slot's cached quantized prefix give the same tokens."""
    path = ckpt.coli("qwen3_moe", "int8", **WIDE_HEADS["qwen3_moe"])
    other = [1, 88, 5, 61, 9, 12, 40]
    with colibri.load(path, ctx_size=96, threads=2, kv_type=("q8_0", "q4_0"), cache_prompt=False) as llm:
        alone, alone2 = greedy(llm), greedy(llm, other)
    with colibri.load(path, ctx_size=96, threads=2, slots=2, kv_type=("q8_0", "q4_0")) as llm:
        h1 = llm.submit(PROMPT, N, ignore_eos=True)
        h2 = llm.submit(other, N, ignore_eos=True)
        assert (h1.wait(), h2.wait()) == (alone, alone2)
        follow = PROMPT + alone + [33, 71]
        h = llm.submit(follow, N, ignore_eos=True)
        got, cached = h.wait(), h.stats.cached_tokens
        assert cached == len(PROMPT) + N - 1
    with colibri.load(path, ctx_size=96, threads=2, kv_type=("q8_0", "q4_0"), cache_prompt=False) as llm:
        assert greedy(llm, follow) == got


def test_prompt_cache_files_carry_the_quantized_rows(ckpt, tmp_path):
    path = ckpt.coli("olmoe", "f32", **WIDE)
    f = tmp_path / "p.cache"
    with colibri.load(path, ctx_size=64, threads=2, kv_type="q4_0") as llm:
        want = greedy(llm)
        assert llm.save_prompt_cache(f) == len(PROMPT) + N - 1
        saved = {k: t.clone() for k, t in llm.slots.caches[0][0].parts().items()}
    state = torch.load(f, weights_only=True)
    assert state["kv"] == "q4_0" and state["layers"][0]["k"].dtype == torch.uint8
    with colibri.load(path, ctx_size=64, threads=2, kv_type="q4_0") as llm:
        assert llm.load_prompt_cache(f) == len(PROMPT) + N - 1
        n = len(PROMPT) + N - 1
        assert torch.equal(llm.slots.caches[0][0].k[:, :n], saved["k"][:, :n])
        h = llm.submit(PROMPT + want + [5], 4, ignore_eos=True)
        h.wait()
        assert h.stats.cached_tokens == n
    with colibri.load(path, ctx_size=64, threads=2, kv_type="q8_0") as llm, \
            pytest.raises(ColibriError, match="holds a q4_0 K/V cache and this engine's is q8_0"):
        llm.load_prompt_cache(f)
    # a format-1 file (no types: the compute dtype's K/V) still loads into a bf16 cache
    with colibri.load(path, ctx_size=64, threads=2) as llm:
        greedy(llm)
        llm.save_prompt_cache(f)
    old = torch.load(f, weights_only=True)
    old["format"] = "colibri-prompt-cache/1"
    del old["kv"]
    torch.save(old, f)
    with colibri.load(path, ctx_size=64, threads=2) as llm:
        assert llm.load_prompt_cache(f) == len(PROMPT) + N - 1
    with colibri.load(path, ctx_size=64, threads=2, kv_type="q8_0") as llm, \
            pytest.raises(ColibriError, match="holds a bf16 K/V cache"):
        llm.load_prompt_cache(f)


def test_memory_is_counted_in_quantized_bytes(ckpt):
    path = ckpt.coli("olmoe", "f32", **WIDE)
    sizes = {}
    for kv in ("bf16", "q8_0", "q4_0"):
        with colibri.load(path, ctx_size=256, threads=2, slots=2, kv_type=kv) as llm:
            sizes[kv] = llm.kv_bytes()
            per_pos, fixed = llm.model.cache_cost(llm.dtype, llm.kv_types)
            assert (per_pos * 256 + fixed) * 2 == sizes[kv]
    # f32 compute: 4 bytes a value; q8_0 1 + 2/32, q4_0 1/2 + 2/32
    assert sizes["q8_0"] * 64 == sizes["bf16"] * 17 and sizes["q4_0"] * 64 == sizes["bf16"] * 9


def test_refusals_are_one_line(ckpt):
    with pytest.raises(ColibriError, match="MLA latent cache is kept in the compute dtype"):
        colibri.load(ckpt.coli("deepseek_v3", "f32"), ctx_size=32, kv_type="q8_0")
    with pytest.raises(ColibriError, match="multiple of 32 .this model's: 16."):
        colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=32, kv_type=("bf16", "q4_0"))


def test_plan_and_run_name_the_cache_and_count_its_bytes(ckpt, capsys):
    from colibri.cli import main

    path = str(ckpt.coli("olmoe", "f32", **WIDE))
    lines = {}
    for kv in ("bf16", "q4_0"):
        assert main(["plan", "--model", path, "--ctx-size", "1000", "--disk-speed", "1G", "-ctk", kv, "-ctv", kv]) == 0
        lines[kv] = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("KV cache:"))
    assert "(bf16 K/V)" in lines["bf16"] and "(q4_0 K/V)" in lines["q4_0"]
    # 3 layers x 2 heads x (K + V) rows of 32 values: 768 bytes in bf16 (the planner's dtype), 216 in q4_0 (2 + 16)
    assert "x 0.8 KiB" in lines["bf16"] and "x 0.2 KiB" in lines["q4_0"], lines
    assert main(["run", "--model", path, "--prompt", "Once upon", "-n", "4", "--temperature", "0", "-ctk", "q8_0",
                 "--ctx-size", "64", "--log-level", "info"]) == 0
    err = capsys.readouterr().err
    assert "(K q8_0, V bf16) for ctx 64" in err, err  # (-ctk alone: the V cache keeps its default)
