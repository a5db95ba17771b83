"""Qwen3.5 MoE (`qwen3_5_moe_text`; the released multimodal `qwen3_5_moe`, whose text model is converted): Qwen3-Next's
layers (qwen3_next.py: Gated DeltaNet and gated full attention, zero-centred norms) with these differences:

- The linear layers' input projections are four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), already
  in GatedDeltaNet's row order.
- Every layer is MoE (no `mlp_only_layers`, `decoder_sparse_step` or dense MLP width), and the router always
  renormalises its top k.
- RoPE is Qwen3-VL's interleaved multimodal one (`mrope_section`); a text-only sequence has the same position on
  its three axes, which is plain RoPE over the rotated channels.
- The multimodal checkpoint keeps the text model under `model.language_model.`; its vision tower
  (`model.visual.`) is dropped; its multi-token-prediction layer (`mtp.`) is kept as Qwen3-Next's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from . import qwen3_next
from .base import text_model_name
from .family import Family

NAME = "qwen3_5_moe_text"


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    split_projections: ClassVar[bool] = True

    norm_topk_prob: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        return super().from_dict({"intermediate_size": 0, **d})  # (no dense layers: no width for them)

    def __post_init__(self):
        super().__post_init__()
        self.norm_topk_prob = True  # (transformers' router renormalises whatever the config says)

    def is_sparse(self, i: int) -> bool:
        return True


class Model(qwen3_next.Model):
    pass


def check_config(cfg: dict) -> None:
    qwen3_next.check_config(cfg, NAME)


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the multimodal checkpoint's text model moves up, its vision tower goes; the MTP
    layer and the linear layers' mixer as in qwen3_next."""
    name = name if name.startswith("mtp.") else text_model_name(name)
    return None if name is None else qwen3_next.sanitize(name)


def prepare(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The zero-centred norms' weights as applied (1 + w, in f32), as qwen3_next's."""
    if name == "model.norm.weight" or name.endswith(qwen3_next.ZERO_CENTRED) or qwen3_next.MTP_NORM.fullmatch(name):
        return 1.0 + t.float()
    return t


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, prepare=prepare,
                mtp_config=qwen3_next.mtp_config)
