"""GLM-4.5V / GLM-4.6V's text model (`glm4v_moe_text`; the released multimodal `glm4v_moe` converts to it): GLM-4.5's
layers (glm4_moe.py: attention biases, partial RoPE, a dense first layer, a shared expert, the sigmoid router
with its selection bias) under the multimodal checkpoint's names:

- The text model sits under `model.language_model.`; the vision tower (`model.visual.`) is dropped, so images are
  not supported.
- RoPE is the multimodal one (`mrope_section` over the rotated half of each head); a text-only sequence has the same
  position on its three axes, which is GLM-4.5's plain partial RoPE.
- The multi-token-prediction layer past the stack (`num_nextn_predict_layers`) is GLM-4.5's, kept as it
  (`glm4_moe.mtp_config`).
"""

from __future__ import annotations

from . import glm4_moe
from .base import text_model_name
from .family import Family

NAME = "glm4v_moe_text"


class ModelArgs(glm4_moe.ModelArgs):
    pass


class Model(glm4_moe.Model):
    pass


def check_config(cfg: dict) -> None:
    glm4_moe.check_config(cfg, NAME)


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the text model moves up, the vision tower goes."""
    return text_model_name(name)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize, mtp_config=glm4_moe.mtp_config)
