"""dots.llm1: which layers slide (transformers' rule, from its own config class) and what is refused by name.
Its oracle, batch, prompt-cache and tier tests run with every family's (tests/hf_tiny.py FAMILIES)."""

from __future__ import annotations

import pytest
from transformers import Dots1Config

from colibri.errors import ColibriError
from colibri.models.dots1 import ModelArgs, check_config
from tests.hf_tiny import tiny_config_kwargs


def _cfg(**over) -> dict:
    return {"model_type": "dots1", **tiny_config_kwargs("dots1"), **over}


@pytest.mark.parametrize("over", [{}, {"max_window_layers": 1}, {"sliding_window": None},
                                  {"max_window_layers": 0, "sliding_window": 5}, {"num_hidden_layers": 64},
                                  {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}])
def test_sliding_layers_follow_transformers(over: dict) -> None:
    cfg = _cfg(**over)
    if over.get("num_hidden_layers") == 64:
        cfg.pop("max_window_layers")  # transformers' default then: 62
    ref = Dots1Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    a = ModelArgs.from_dict(cfg)
    got = [a.window(i) for i in range(a.num_hidden_layers)]
    want = [ref.sliding_window if kind == "sliding_attention" else None for kind in ref.layer_types]
    assert got == want
    # ... and a config written by transformers (layer_types saved) gives the same
    assert [ModelArgs.from_dict(ref.to_dict()).window(i) for i in range(a.num_hidden_layers)] == want


@pytest.mark.parametrize("over,field", [({"attention_bias": True}, "attention_bias"),
                                        ({"scoring_func": "softmax"}, "scoring_func"),
                                        ({"hidden_act": "gelu"}, "hidden_act"),
                                        ({"layer_types": ["full_attention"]}, "layer_types"),
                                        ({"n_group": 3}, "n_group")])
def test_unsupported_configs_are_refused_by_name(over: dict, field: str) -> None:
    check_config(_cfg())
    with pytest.raises(ColibriError, match=field):
        check_config(_cfg(**over))
