"""IBM Granite 3.x MoE (`granitemoe`). The oracle, batch, tier, prompt-cache and native-accuracy tests run it with
every family (tests/tiny_configs.py FAMILIES; test_native_step.py its one-call step); here the tied head the
released models have, the folded multipliers, the router and the refusals."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_logits, load_hf

import colibri
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.layers.moe import SoftmaxTopKRouter
from colibri.models.granitemoe import check_config, sanitize

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


def test_a_tied_head_is_divided_by_logits_scaling_alone(ckpt) -> None:
    """Released Granite ties lm_head to the embedding: the container stores each with its own multiplier."""
    over = {"tie_word_embeddings": True, "embedding_multiplier": 12.0, "logits_scaling": 6.0}
    ref = hf_logits(load_hf(ckpt.hf("granitemoe", **over)), PROMPT)
    path = ckpt.coli("granitemoe", "f32", **over)
    with colibri.load(path, ctx_size=64, threads=2) as llm:
        got = llm.logits(PROMPT).float()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    with Container(path) as c:
        emb, head = c.tensor("model.embed_tokens.weight"), c.tensor("lm_head.weight")
    torch.testing.assert_close(emb.float() / 12.0, head.float() * 6.0, rtol=1e-6, atol=0)


def test_the_router_softmaxes_its_top_k_and_scales() -> None:
    torch.manual_seed(0)
    r = SoftmaxTopKRouter(32, 8, 3, bias=False, scale=0.25)
    r.weight.data = torch.randn(8, 32)
    x = torch.randn(20, 32)
    idx, w = r(x)
    top, ref_idx = (x @ r.weight.T).topk(3, -1)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, torch.softmax(top, -1) * 0.25)
    idx_b, w_b = r(x.bfloat16())  # (the kernels' rule on bf16 rows)
    assert torch.equal(idx_b, r(x.bfloat16().float())[0])
    torch.testing.assert_close(w_b, r(x.bfloat16().float())[1], rtol=1e-5, atol=1e-6)


def test_names_and_refusals() -> None:
    assert sanitize("model.layers.2.block_sparse_moe.input_linear.weight") == "model.layers.2.mlp.experts.gate_up_proj"
    assert sanitize("model.layers.2.block_sparse_moe.output_linear.weight") == "model.layers.2.mlp.experts.down_proj"
    assert sanitize("model.layers.2.block_sparse_moe.router.layer.weight") == "model.layers.2.mlp.gate.weight"
    assert sanitize("model.layers.2.block_sparse_moe.router.weight") == "model.layers.2.mlp.gate.weight"
    for change, want in (({"hidden_act": "gelu"}, "only silu"), ({"residual_multiplier": 0}, "a number > 0"),
                         ({"head_dim": 32}, "hidden_size / num_attention_heads")):
        with pytest.raises(ColibriError, match=f"granitemoe.*{want}"):
            check_config({"hidden_size": 64, "num_attention_heads": 4, **change})
