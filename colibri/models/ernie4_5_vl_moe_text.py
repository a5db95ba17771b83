"""ERNIE-4.5-VL's text model (`ernie4_5_vl_moe_text`; the released multimodal `ernie4_5_vl_moe`, 28B-A3B and
424B-A47B, converts to it): ERNIE-4.5's layers (ernie4_5_moe.py) whose MoE layers hold two sets of experts, one
for text tokens and one for image and video tokens, each with its own router, beside shared experts:

- Text in, text out: every token is a text token, so only the text experts (`text_moe`, width
  moe_intermediate_size[0]) and the shared experts (moe_num_shared_experts of that width) run; the vision
  experts, the vision tower and its resampler are dropped at conversion, so images are not supported.
- RoPE is the multimodal one (3 axes, `mrope_section` [h, w, t] over the head's frequency pairs, the h and w
  frequencies pre-split into even and odd ones). A text token has the same position on all three axes, and
  with h == w the sections interleave back into the plain frequencies: ERNIE-4.5's interleaved RoPE, turned
  into rotate-half rows at conversion as for ERNIE-4.5 (tests/test_ernie4_5_vl.py checks both against
  transformers).
- Dense and MoE layers follow `mlp_layer_types` (transformers' default: the first layer dense).
- Two checkpoint layouts: transformers' (`model.language_model.`, `mlp.text_moe.` / `mlp.vision_moe.` with
  fused experts) and the release's (`model.layers.`; per-expert `mlp.experts.{j}`, the text experts first, then
  as many vision experts; the text router `mlp.gate.weight` stored [hidden, experts] beside the vision one's
  `weight_1`; `mlp.moe_statics.e_score_correction_bias` [2, experts], text row first), read through
  `source_view`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from . import ernie4_5_moe
from .base import check_act_and_rope, refuse, text_model_name
from .family import Family

NAME = "ernie4_5_vl_moe_text"
_TEXT = re.compile(r"model\.(layers\.\d+\.|embed_tokens\.|norm\.)|lm_head\.")  # the text model's tensors
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_ROUTER = re.compile(r"model\.layers\.\d+\.mlp\.gate\.weight")  # (the release's: [hidden, experts])
_BIAS = re.compile(r"model\.layers\.\d+\.mlp\.moe_statics\.e_score_correction_bias")  # (the release's: [2, E])


@dataclass
class ModelArgs(ernie4_5_moe.ModelArgs):
    mlp_layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (self.num_hidden_layers - 1)

    def is_sparse(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"


def flat_config(cfg: dict) -> dict:
    """The text experts' count and width where the config gives [text, vision] pairs (`moe_num_experts`,
    `moe_intermediate_size`): what this model runs."""
    out = dict(cfg)
    e = cfg.get("moe_num_experts")
    if isinstance(e, list) and (len(e) != 2 or e[0] != e[1]):
        refuse(NAME, "moe_num_experts", e, "as many vision experts as text experts (the release's layout)")
    for key in ("moe_num_experts", "moe_intermediate_size"):
        if isinstance(cfg.get(key), list) and cfg[key]:
            out[key] = cfg[key][0]
    return out


class Model(ernie4_5_moe.Model):
    pass


def check_config(cfg: dict) -> None:
    check_act_and_rope(NAME, cfg)
    if cfg.get("use_bias"):
        refuse(NAME, "use_bias", cfg["use_bias"], "the released models have no linear biases")
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", "default") != "default":
        refuse(NAME, "rope_parameters.rope_type", rp.get("rope_type"), "default only, as transformers' port")
    a = ModelArgs.from_dict(cfg)
    sec = rp.get("mrope_section", [22, 22, 20])
    if not (isinstance(sec, list) and len(sec) == 3 and sec[0] == sec[1] and sum(sec) == a.head_dim // 2):
        refuse(NAME, "rope_parameters.mrope_section", sec,
               f"[h, w, t] with h == w and h + w + t = head_dim / 2 = {a.head_dim // 2}")
    types = cfg.get("mlp_layer_types")
    if types is not None and (len(types) != a.num_hidden_layers or set(types) - {"dense", "sparse"}):
        refuse(NAME, "mlp_layer_types", types, f"{a.num_hidden_layers} entries of 'dense' / 'sparse'")


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the text model's tensors (the text experts under `mlp.experts`, their router
    and its bias under `mlp.gate`); the vision experts, tower and resampler go."""
    name = text_model_name(name)
    if name is None or not _TEXT.match(name) or ".mlp.vision_moe." in name or name.endswith(".mlp.gate.weight_1"):
        return None
    return ernie4_5_moe.sanitize(name.replace(".mlp.text_moe.", ".mlp."))


class _ReleaseView:
    """The release's tensors as transformers' text model reads them: the vision experts (index >= E) hidden,
    the text router transposed to [E, hidden], the correction bias's text row alone."""

    def __init__(self, st, n_experts: int):
        self.st, self.n = st, n_experts

    def __getattr__(self, attr):  # folder and the like: as stored
        return getattr(self.st, attr)

    def names(self) -> list[str]:
        return [n for n in self.st.names() if not ((m := _EXPERT.match(n)) and int(m[1]) >= self.n)]

    @property
    def hidden(self) -> list[str]:  # (the converter lists them as dropped)
        return [n for n in self.st.names() if (m := _EXPERT.match(n)) and int(m[1]) >= self.n]

    def shape(self, name: str) -> tuple[int, ...]:
        s = tuple(self.st.shape(name))
        if _ROUTER.fullmatch(name):
            return s[::-1]
        return (1, *s[1:]) if _BIAS.fullmatch(name) else s

    def nbytes(self, name: str) -> int:
        n = self.st.nbytes(name)
        return n // max(self.st.shape(name)[0], 1) if _BIAS.fullmatch(name) else n

    def read(self, name: str, index: int | None = None, of: int | None = None) -> torch.Tensor:
        if _ROUTER.fullmatch(name):
            return self.st.read(name).T.contiguous()
        if _BIAS.fullmatch(name):
            return self.st.read(name)[:1]
        return self.st.read(name, index, of) if of is not None else self.st.read(name, index)


def source_view(st, cfg: dict):
    return _ReleaseView(st, ModelArgs.from_dict(cfg).num_experts)


prepare = ernie4_5_moe.prepare


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, flat_config=flat_config, source_view=source_view,
                sanitize=sanitize, prepare=prepare)
