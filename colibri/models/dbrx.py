"""DBRX (`dbrx`: Databricks' dbrx-base / dbrx-instruct, 132B with 16 experts, 4 active): Mixtral's layers with
these differences:

- its config is nested (`attn_config`, `ffn_config`) under its own names (`d_model`, `n_heads`, ...):
  `flat_config` maps it onto the flat fields every family reads, at conversion (the container keeps the flat
  one). RoPE's base is `attn_config.rope_theta`, the field the released models were trained with (transformers
  5 reads `rope_parameters` instead, 1e4 when a config lacks it; the test's model sets both alike);
- LayerNorms without a bias (`norm_1`, `norm_2`, `norm_f`);
- q, k and v fused as `Wqkv` [H + 2·kv·D, H]: the converter reads its three row blocks as q/k/v_proj
  (`source_view`); q, k and v are clamped to ±`clip_qkv` (the kernels' attention block does it too);
- the experts fused per layer as `w1` (gate), `v1` (up) and `w2` (down, transposed), each [E·I, H]: read as
  [E, I, H], one expert at a time, `w2`'s transposed back (`expert_record`);
- the router: softmax over all experts, top-k, weights divided by their p-norm: p = 1 as released (Mixtral's
  renormalised rule), none when `moe_normalize_expert_weights` is null; other p are refused.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..convert.safetensors_reader import SplitRows
from ..errors import ColibriError
from ..layers.attention import AttentionArgs
from ..layers.layers import LayerNorm
from ..layers.moe import TopKRouter
from . import mixtral
from .base import check_act_and_rope, refuse
from .family import Family

NAME = "dbrx"


@dataclass
class ModelArgs(mixtral.ModelArgs):
    """Mixtral's fields (from `flat_config`) and DBRX's own."""

    clip_qkv: float | None = None
    norm_topk_prob: bool = True  # moe_normalize_expert_weights 1, not null (flat_config)


class Model(mixtral.Model):
    def __init__(self, a: ModelArgs):
        super().__init__(a)
        for block in self.model.layers:
            block.input_layernorm = LayerNorm(a.hidden_size, a.rms_norm_eps, bias=False)
            block.post_attention_layernorm = LayerNorm(a.hidden_size, a.rms_norm_eps, bias=False)
        self.model.norm = LayerNorm(a.hidden_size, a.rms_norm_eps, bias=False)

    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        args = super().attention_args(a, i)
        return dataclasses.replace(args, scores=dataclasses.replace(args.scores, clip_qkv=a.clip_qkv))

    @classmethod
    def router(cls, a: ModelArgs) -> nn.Module:
        return TopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, a.norm_topk_prob)


def _section(cfg: dict, key: str) -> dict:
    sub = cfg.get(key)
    if sub is None:
        return {}
    if not isinstance(sub, dict):
        raise ColibriError(f"{NAME}: {key} must be an object, got {type(sub).__name__}")
    return sub


def flat_config(cfg: dict) -> dict:
    """The released nested config as the flat fields the converter, the validator and ModelArgs read
    (transformers' DbrxConfig defaults where a field is absent)."""
    attn, ffn = _section(cfg, "attn_config"), _section(cfg, "ffn_config")
    act = ffn.get("ffn_act_fn") or {"name": "silu"}
    if not isinstance(act, dict):
        raise ColibriError(f"{NAME}: ffn_config.ffn_act_fn must be an object, got {type(act).__name__}")
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        refuse(NAME, "rope_parameters.rope_type", scaling.get("rope_type", scaling.get("type")),
               "only default, as released")
    flat = {k: v for k, v in cfg.items() if k not in ("attn_config", "ffn_config", "rope_parameters", "rope_scaling")}
    flat.update(hidden_size=cfg.get("d_model", 2048), num_attention_heads=cfg.get("n_heads", 16),
                num_hidden_layers=cfg.get("n_layers", 24), max_position_embeddings=cfg.get("max_seq_len", 2048),
                num_key_value_heads=attn.get("kv_n_heads", 1), rope_theta=attn.get("rope_theta", 10000.0),
                clip_qkv=attn.get("clip_qkv"), intermediate_size=ffn.get("ffn_hidden_size", 3584),
                num_local_experts=ffn.get("moe_num_experts", 4), num_experts_per_tok=ffn.get("moe_top_k", 1),
                moe_normalize_expert_weights=ffn.get("moe_normalize_expert_weights", 1.0),
                norm_topk_prob=ffn.get("moe_normalize_expert_weights", 1.0) is not None,
                hidden_act=act.get("name", "silu"))
    for key in ("head_dim", "num_key_value_heads_per_layer"):
        flat.pop(key, None)  # (a stray flat field would contradict the nested config's)
    return flat


def check_config(cfg: dict) -> None:
    """Refuse DBRX configs this file does not implement (on the flat config)."""
    check_act_and_rope(NAME, cfg)
    p = cfg.get("moe_normalize_expert_weights")
    if p is not None and p != 1:
        refuse(NAME, "ffn_config.moe_normalize_expert_weights", p, "1 (as released) or null")
    clip = cfg.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0):
        refuse(NAME, "attn_config.clip_qkv", clip, "a number > 0 or null")
    if cfg.get("tie_word_embeddings"):
        refuse(NAME, "tie_word_embeddings", True, "DBRX's head is its own tensor")


_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.")
_RENAMES = (("norm_attn_norm.norm_1.", "input_layernorm."), ("norm_attn_norm.norm_2.", "post_attention_layernorm."),
            ("norm_attn_norm.attn.out_proj.", "self_attn.o_proj."), ("norm_attn_norm.attn.", "self_attn."),
            ("ffn.router.layer.", "mlp.gate."), ("ffn.experts.mlp.w1", "mlp.experts.gate_proj"),
            ("ffn.experts.mlp.v1", "mlp.experts.up_proj"), ("ffn.experts.mlp.w2", "mlp.experts.down_proj"))


def sanitize(name: str) -> str | None:
    """HF name (after `source_view`) -> canonical name."""
    if name.startswith("transformer.wte."):
        return "model.embed_tokens." + name.removeprefix("transformer.wte.")
    if name.startswith("transformer.norm_f."):
        return "model.norm." + name.removeprefix("transformer.norm_f.")
    if m := _BLOCK.match(name):
        rest = name[m.end():]
        for old, new in _RENAMES:
            if rest.startswith(old):
                return f"model.layers.{m.group(1)}.{new}{rest.removeprefix(old)}"
    return name


class _Source(SplitRows):
    """The checkpoint as the converter reads it: each `Wqkv` as three tensors (its q, k and v row blocks) and the
    fused experts [E·I, H] as [E, I, H], read one expert at a time (the reader's `of` slices)."""

    def __init__(self, st, cfg: dict):
        hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        q, k = hidden, kv * (hidden // heads)  # rows of q, and of k (= of v)
        split = {}
        for n in st.names():
            if n.endswith(".attn.Wqkv.weight"):
                for part, (a, b) in (("q_proj", (0, q)), ("k_proj", (q, q + k)), ("v_proj", (q + k, q + 2 * k))):
                    split[n.replace(".Wqkv.", f".{part}.")] = (n, a, b)
        super().__init__(st, split)
        self.n_experts = cfg["num_local_experts"]
        self.experts = {n for n in st.names() if re.search(r"\.ffn\.experts\.mlp\.(w1|v1|w2)$", n)}

    def shape(self, name: str) -> tuple[int, ...]:
        shape = super().shape(name)
        if name in self.experts:
            return (self.n_experts, shape[0] // self.n_experts, *shape[1:])
        return shape

    def read(self, name: str, index: int | None = None, of: int | None = None) -> torch.Tensor:
        if name in self.experts and index is not None:
            return super().read(name, index, of=self.n_experts)
        return super().read(name, index, of)


def source_view(st, cfg: dict):
    """The safetensors folder as `sanitize` and the converter expect it (see `_Source`)."""
    return _Source(st, cfg)


def expert_record(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One expert: gate_up = [w1 rows; v1 rows] ([2I, H]), down = w2's [I, H] transposed ([H, I])."""
    return {"gate_up.weight": torch.cat([parts["gate"], parts["up"]], 0),
            "down.weight": parts["down"].t().contiguous()}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, flat_config=flat_config, source_view=source_view,
                sanitize=sanitize, expert_record=expert_record)
