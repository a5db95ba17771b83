"""Qwen3-Omni's thinker text model (`qwen3_omni_moe_text`; the released `qwen3_omni_moe`, Qwen3-Omni-30B-A3B
Instruct / Thinking / Captioner, and a thinker saved alone, `qwen3_omni_moe_thinker`, convert to it): Qwen3-MoE's
layers (qwen3_moe.py: per-head q/k norms, the softmax top-k router renormalised where `norm_topk_prob` says) under
the omni checkpoint's names:

- The thinker's text model sits under `thinker.model.` (the released model, beside the talker and the code-to-wave
  decoder that speak) or `model.language_model.` (transformers' layout); its audio and vision encoders, the talker
  and code2wav are dropped, so text in, text out: no audio, images or speech.
- RoPE is the interleaved multimodal one (`mrope_section`); a text-only sequence has the same position on its three
  axes, which is plain RoPE.
"""

from __future__ import annotations

from . import qwen3_moe
from .base import check_act_and_rope, refuse, text_model_name
from .family import Family

NAME = "qwen3_omni_moe_text"
_DROPPED = ("talker.", "code2wav.", "model.audio_tower.", "audio_tower.")


class ModelArgs(qwen3_moe.ModelArgs):
    pass


class Model(qwen3_moe.Model):
    pass


def check_config(cfg: dict) -> None:
    check_act_and_rope(NAME, cfg)
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", "default") != "default":
        refuse(NAME, "rope_parameters.rope_type", rp.get("rope_type"), "default (the released M-RoPE)")
    if cfg.get("use_sliding_window"):  # (transformers' thinker attends unwindowed, while its generation cache
        # keeps the window: no one answer to follow)
        refuse(NAME, "use_sliding_window", True, "the released thinker has no sliding window")
    if cfg.get("attention_bias"):
        refuse(NAME, "attention_bias", True, "the released thinker has no attention biases")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the thinker's text model moves up; its encoders, the talker and code2wav go."""
    if name.startswith(_DROPPED):
        return None
    name = text_model_name(name.removeprefix("thinker."))
    return None if name is None or name.startswith(_DROPPED) else name


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
