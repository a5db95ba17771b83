"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's layers (deepseek_v32.py: MLA, DeepSeek Sparse Attention, V3's router
and shared expert) with GLM's defaults and two differences:

- The indexer's RoPE rotates interleaved pairs (V3.2's rotates halves).
- Cross-layer top-k sharing: a "shared" layer (`indexer_types`, else from `index_topk_pattern` or
  `index_topk_freq` / `index_skip_topk_offset`, transformers' rules) has no indexer and attends to the positions
  the last "full" layer before it selected in the same step.
- The MTP layer (layer `num_hidden_layers`) is a "full" one: the checkpoint ships its indexer (`mtp_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import deepseek_v32 as v32
from .base import refuse
from .family import Family

NAME = "glm_moe_dsa"
KINDS = ("full", "shared")


@dataclass
class ModelArgs(v32.ModelArgs):
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    index_n_heads: int = 32
    n_group: int = 1
    topk_group: int = 1
    indexer_types: list | None = None

    def kinds(self) -> list[str]:
        return indexer_kinds(self.raw or {}, self.num_hidden_layers)


def indexer_kinds(cfg: dict, n: int) -> list[str]:
    """Per layer "full" (its own indexer) or "shared", as transformers' GlmMoeDsaConfig decides."""
    if cfg.get("indexer_types") is not None:
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


class Model(v32.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        mla, carrier = a.mla(), v32.Selection()
        for b, kind in zip(self.model.layers, a.kinds()):
            b.self_attn = v32.DSAttention(mla, a, kind == "shared", carrier, index_interleaved=True)


def check_config(cfg: dict) -> None:
    v32.check_config(cfg)
    n = int(cfg.get("num_hidden_layers") or 0)
    kinds = indexer_kinds(cfg, n)
    if len(kinds) != n or any(k not in KINDS for k in kinds) or (kinds and kinds[0] != "full"):
        refuse(NAME, "indexer_types", kinds, f'{n} of "full" / "shared", the first "full"')


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (routed, its own indexer) as layer 0 of a one-layer model."""
    return {**v32.mtp_config(cfg), "indexer_types": ["full"]}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, mtp_config=mtp_config)
