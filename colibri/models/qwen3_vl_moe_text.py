"""Qwen3-VL MoE's text model (`qwen3_vl_moe_text`; the released multimodal `qwen3_vl_moe`, Qwen3-VL-30B-A3B and
-235B-A22B, converts to it): Qwen3-MoE's layers (qwen3_moe.py) with these differences:

- The router always renormalises its top k (transformers' Qwen3VLMoeTextTopKRouter has no switch for it).
- RoPE is the interleaved multimodal one (`mrope_section`); a text-only sequence has the same position on its three
  axes, which is plain RoPE.
- The checkpoint keeps the text model under `model.language_model.`; the vision tower (`model.visual.`) is dropped,
  so images are not supported (and the vision-derived "deepstack" inputs of the first layers with them).
- The experts are fused `[E, ...]` tensors, stored as released with x @ W (gate_up [E, H, 2I], down [E, I, H],
  which transformers transposes on load) or as transformers saves them ([E, 2I, H], [E, H, I]): `expert_record`
  tells the two apart by the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ColibriError
from . import qwen3_moe
from .base import text_model_name
from .family import Family

NAME = "qwen3_vl_moe_text"


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    def __post_init__(self):
        super().__post_init__()
        self.norm_topk_prob = True  # (transformers' router renormalises whatever the config says)


class Model(qwen3_moe.Model):
    pass


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the text model moves up, the vision tower goes."""
    return text_model_name(name)


def expert_record(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert's canonical record (gate_up [2I, H]: gate rows then up rows; down [H, I]) from either fused layout:
    transformers' own, gate_up [2I, H] with down [H, I], or the released x @ W one, gate_up [H, 2I] with down [I, H]
    (the two never agree on which of gate_up's dims is twice one of down's)."""
    if "gate_up" not in parts or "down" not in parts:
        raise ColibriError(f"qwen3_vl_moe expert lacks gate_up/down (have {sorted(parts)})")
    gu, dn = parts["gate_up"], parts["down"]
    if gu.dim() != 2 or dn.dim() != 2:
        raise ColibriError(f"qwen3_vl_moe expert tensors must be 2-D per expert, got {tuple(gu.shape)} / "
                           f"{tuple(dn.shape)}")
    if gu.shape[0] == 2 * dn.shape[1] and gu.shape[1] == dn.shape[0]:
        return {"gate_up.weight": gu, "down.weight": dn}
    if gu.shape[1] == 2 * dn.shape[0] and gu.shape[0] == dn.shape[1]:
        return {"gate_up.weight": gu.T.contiguous(), "down.weight": dn.T.contiguous()}
    raise ColibriError(f"qwen3_vl_moe experts: gate_up {tuple(gu.shape)} and down {tuple(dn.shape)} fit neither "
                       "layout ([2I, H] with [H, I], or [H, 2I] with [I, H])")


FAMILY = Family(NAME, ModelArgs, Model, sanitize=sanitize, expert_record=expert_record)
