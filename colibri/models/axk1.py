"""SK Telecom's A.X K1 (`axk1`): DeepSeek-V3's layers (deepseek_v3.py: MLA with a q LoRA, the bias-corrected
group-limited sigmoid router, a shared expert) with one change: the MoE block's output, routed + shared, is
RMSNorm'd before the residual add (`mlp.out_norm` here, as AFMoE's; the kernels' MoE block takes it).

- Which layers are MoE: `mlp_layer_types`, else transformers' rule from `first_k_dense_replace` (default 1) and
  `moe_layer_freq`; router defaults are AXK1Config's (8 groups, the best 4 kept, scale 2.5).
- Converter: the release keeps the norm at the decoder layer (`post_mlp_layernorm`), for dense layers too, where
  transformers ignores it: the sparse layers' becomes `mlp.out_norm`, the dense layers' are dropped and listed in
  the header (`IGNORED`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..layers.layers import RMSNorm
from . import deepseek_v3 as v3
from .base import refuse
from .family import Family

NAME = "axk1"
# Tensors a checkpoint may hold that the model does not use (transformers' _keys_to_ignore_on_load_unexpected): the
# converter drops them where the model has no such tensor, and lists them.
IGNORED = re.compile(r"model\.layers\.\d+\.mlp\.out_norm\.weight")


@dataclass
class ModelArgs(v3.ModelArgs):
    aliases = {"num_local_experts": "n_routed_experts"}

    first_k_dense_replace: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 32768
    mlp_layer_types: list | None = None

    def is_moe(self, i: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[i] == "sparse"
        return super().is_moe(i)


class Model(v3.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        for i, block in enumerate(self.model.layers):
            if a.is_moe(i):
                block.mlp.out_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


def check_config(cfg: dict) -> None:
    """DeepSeek-V3's refusals, plus A.X K1's: a q LoRA (its attention always has one), a valid layer list."""
    v3.check_config(cfg)
    if not cfg.get("q_lora_rank", 1536):
        refuse(NAME, "q_lora_rank", cfg["q_lora_rank"], "A.X K1's attention always has a q LoRA")
    n = int(cfg.get("num_hidden_layers") or 0)
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != n
                              or any(k not in ("dense", "sparse") for k in kinds)):
        refuse(NAME, "mlp_layer_types", kinds, f'{n} entries of "dense" or "sparse"')


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the release's decoder-level MoE output norm (transformers: `mlp.post_mlp_layernorm`)
    is the MoE block's `out_norm` here."""
    if ".mlp.post_mlp_layernorm." in name:
        return name.replace(".mlp.post_mlp_layernorm.", ".mlp.out_norm.")
    return name.replace(".post_mlp_layernorm.", ".mlp.out_norm.")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, ignored=IGNORED)
