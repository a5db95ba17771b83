"""Llama (transformers' LlamaForCausalLM): the dense decoder the MoE families grew from, here mostly as the small
draft model of speculative decoding (Llama-3.2-1B / 3B, TinyLlama, SmolLM). GQA attention with RoPE over the whole
head (the scaled types of layers/layers.py: llama3, linear, yarn), q/k/v and o_proj biases by `attention_bias`, a
SwiGLU MLP in every layer, the head tied to the embedding where `tie_word_embeddings` says so (the converter
stores the embedding's rows as lm_head). No layer is MoE: the engine runs it as an MoE model with no experts.

Qwen2 and Qwen3 (qwen2.py, qwen3.py) are this skeleton with their own attention settings."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers.attention import Attention, AttentionArgs, Output, Positions, QKNorm, Scores
from ..layers.layers import MLP, DecoderBlock, rope_scaling, rope_theta
from .base import BaseArgs, CausalLM, check_act_and_rope, refuse
from .family import Family

NAME = "llama"


@dataclass
class ModelArgs(BaseArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    raw: dict | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it sees every earlier position)."""
        return None


def check_config(cfg: dict, name: str = NAME) -> None:
    """The shared refusals (activation, RoPE type), plus MLP biases, which the dense MLP block has no place for."""
    check_act_and_rope(name, cfg)
    if cfg.get("mlp_bias"):
        refuse(name, "mlp_bias", True, "the MLP's projections take no bias")


class Model(CausalLM):
    """Embedding -> [attention, SwiGLU MLP] x L -> norm -> lm_head; a family built on it swaps `attention_args`."""

    def __init__(self, a: ModelArgs):
        blocks = [DecoderBlock(Attention(self.attention_args(a, i)), MLP(a.hidden_size, a.intermediate_size),
                               a.hidden_size, a.rms_norm_eps)
                  for i in range(a.num_hidden_layers)]
        super().__init__(a.vocab_size, a.hidden_size, a.rms_norm_eps, blocks)
        self.args = a

    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        """Layer i's attention: Llama's biases sit on q, k, v and o alike."""
        return AttentionArgs(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                             cls.positions(a), bias=a.attention_bias, qk_norm=QKNorm.NONE, norm_eps=a.rms_norm_eps,
                             scores=Scores(sliding_window=a.window(i)), output=Output(o_bias=a.attention_bias))

    @staticmethod
    def positions(a: ModelArgs) -> Positions:
        raw = a.raw or {}
        return Positions(rope_theta(raw), rope_scaling(raw), a.max_position_embeddings)


def sanitize(name: str) -> str | None:
    """Checkpoints saved by transformers before 4.31 (Llama 2's) carry each layer's RoPE table as
    `self_attn.rotary_emb.inv_freq`: dropped (listed in the header), the model builds its own from the config."""
    return None if name.endswith(".rotary_emb.inv_freq") else name


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, sanitize=sanitize)
