"""int8 / int4 containers against the bf16 container of the same checkpoint: agreement floors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import colibri

PROMPTS = [[1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3, 88, 120, 31, 9],
           [1, 250, 251, 33, 34, 35, 90, 91, 92, 17, 18, 19, 300, 301, 302, 5]]
# Measured on these tiny random models (hidden 64, uniform random weights: a worst case for
# quantization): int8 cosine 0.995-0.9997, top-1 97-100%; int4 g32 cosine 0.93-0.98, top-1 56-75%.
# The floors sit a little below, so a broken kernel (cosine ~0) fails loudly.
FLOORS = {"int8": (0.99, 0.9), "int4": (0.90, 0.5)}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_quantized_agrees_with_bf16(ckpt, model_type, scheme):
    ref = colibri.load(ckpt.coli(model_type, "bf16"), ctx_size=64, threads=2)
    q = colibri.load(ckpt.coli(model_type, scheme), ctx_size=64, threads=2)
    cos, agree, n = [], 0, 0
    for ids in PROMPTS:
        a, b = ref.logits(ids), q.logits(ids)
        cos.append(F.cosine_similarity(a, b, dim=-1))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += len(ids)
    cosine, top1 = torch.cat(cos).mean().item(), agree / n
    print(f"{model_type} {scheme}: mean logit cosine {cosine:.4f}, top-1 agreement {top1:.1%}")
    min_cos, min_top1 = FLOORS[scheme]
    assert cosine >= min_cos
    assert top1 >= min_top1


def test_quantized_containers_are_smaller(ckpt):
    sizes = {s: ckpt.coli("mixtral", s).stat().st_size for s in ("f32", "bf16", "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"] < sizes["f32"]


# ----------------------------------------------------------------------------- the KV cache in 8 and 4 bits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_demo_model as demo  # noqa: E402  (the demo's story generator: text it never saw in training)

# Measured on the demo (trained, so its attention has real structure) over these 40 stories, windows of 256 (its
# training length) every 128, against its own bf16 cache: q8_0 K/V mean KL 2.4e-4, top-1 99.92%; q4_0 K/V 4.4e-3,
# 99.23% (docs/QUANT.md has the table over the full evaluation text). The floors allow ~3x the KL and a little less
# agreement; a cache read with the wrong scales or nibbles lands far outside them.
KV_FLOORS = {"q8_0": (7e-4, 0.995), "q4_0": (0.013, 0.985)}


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantized_kv_cache_stays_close_to_bf16_on_the_demo(kv):
    from colibri.analysis.perplexity import perplexity
    from colibri.demo import demo_model

    text = demo.make_corpus(n_stories=40, seed=demo.SEED + 2)
    with colibri.load(demo_model(), ctx_size=256, threads=2, slots=4) as base, \
            colibri.load(demo_model(), ctx_size=256, threads=2, slots=4, kv_type=kv) as q:
        r = perplexity(q, text, 256, 128, base, progress=False)
    print(f"{kv}: KL mean {r.kl.mean_kl:.6f} p99 {r.kl.p99_kl:.5f}, top-1 {r.kl.top1_agreement:.2%}, "
          f"{r.tokens_scored} tokens")
    max_kl, min_top1 = KV_FLOORS[kv]
    assert 0 < r.kl.mean_kl < max_kl
    assert r.kl.top1_agreement >= min_top1
