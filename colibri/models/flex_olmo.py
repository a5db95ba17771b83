"""AllenAI's FlexOlmo (`flex_olmo`: FlexOlmo-7x7B-1T and its variants): OLMoE's layers (q/k RMSNorm over the whole
projections, a softmax top-k router) with OLMo 2's norm placement: no norm before a sublayer, an RMSNorm of each
sublayer's output before the residual add, h + norm(attn(h)), then h + norm(mlp(h)). The released
`post_attention_layernorm` and `post_feedforward_layernorm` are those output norms (`self_attn.out_norm`,
`mlp.out_norm` here); the blocks' input / pre-MLP norms are `NoNorm`s, which the kernels' attention block takes as
none (a NULL weight), so every layer runs in the one-call step at int8 / int4.
"""

from __future__ import annotations

import dataclasses

from ..layers.attention import Attention
from ..layers.layers import NoNorm, RMSNorm
from . import olmoe
from .base import check_act_and_rope, rename_first
from .family import Family

NAME = "flex_olmo"
ModelArgs = olmoe.ModelArgs


class Model(olmoe.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        for block in self.model.layers:  # (OLMoE's attention with an output norm; the MoE's output normed too)
            args = block.self_attn.a
            output = dataclasses.replace(args.output, out_norm=True)
            block.self_attn = Attention(dataclasses.replace(args, output=output))
            block.mlp.out_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
            block.input_layernorm, block.post_attention_layernorm = NoNorm(), NoNorm()


def check_config(cfg: dict) -> None:
    check_act_and_rope(NAME, cfg)


_RENAMES = ((".post_attention_layernorm.", ".self_attn.out_norm."), (".post_feedforward_layernorm.", ".mlp.out_norm."))


def sanitize(name: str) -> str | None:
    """HF name -> canonical name: the released output norms inside their sublayers."""
    return rename_first(name, _RENAMES)


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
