"""GLM-5 (glm_moe_dsa): which layers run their own indexer as transformers decides it, the shared layers' lack of
one (no weights, no indexer keys cached), refusals. Its oracle, batch, prompt-cache and tier tests run with every
family's (tests/hf_tiny.py FAMILIES: layer 1 shares layer 0's selection of 8 positions)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_config_kwargs
from transformers import GlmMoeDsaConfig

from colibri.errors import ColibriError
from colibri.models.base import build, expected_tensors
from colibri.models.deepseek_v32 import IndexedLatentCache
from colibri.models.glm_moe_dsa import check_config, indexer_kinds


@pytest.mark.parametrize("kw", [{}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                                {"index_topk_pattern": "FSSF"}])
def test_indexer_kinds_follow_transformers(kw) -> None:
    cfg = {k: v for k, v in tiny_config_kwargs("glm_moe_dsa").items() if k != "indexer_types"} | \
        {"num_hidden_layers": 4}
    ref = GlmMoeDsaConfig(**cfg, **kw).indexer_types
    assert indexer_kinds({**cfg, **kw}, 4) == ref


def test_shared_layers_have_no_indexer() -> None:
    cfg = {"model_type": "glm_moe_dsa", **tiny_config_kwargs("glm_moe_dsa")}  # full, shared, full
    model, _ = build("glm_moe_dsa", cfg)
    names = expected_tensors(model)
    assert [any(n.startswith(f"model.layers.{i}.self_attn.indexer.") for n in names) for i in range(3)] == \
        [True, False, True]
    caches = model.make_cache(16, torch.float32)
    assert [isinstance(c, IndexedLatentCache) for c in caches] == [True, False, True]


@pytest.mark.parametrize("over,field", [
    ({"indexer_types": ["shared", "full", "full"]}, "indexer_types"),  # nothing to share from
    ({"indexer_types": ["full", "other", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types"),
    ({"q_lora_rank": None}, "q_lora_rank")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    cfg = {"model_type": "glm_moe_dsa", **tiny_config_kwargs("glm_moe_dsa")}
    check_config(cfg)
    with pytest.raises(ColibriError, match=field):
        check_config(cfg | over)
