"""What every family shares: config dataclasses, the decoder skeleton, binding weights from a store."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, NoReturn

import torch
from torch import nn

from ..errors import ColibriError
from ..layers.batch import StepBatch
from ..layers.kvquant import DEFAULT, KVTypes
from ..layers.layers import ROPE_TYPES, Embedding, Linear, RMSNorm, rope_scaling
from ..layers.moe import SwitchGLU
from .family import family

# layer kinds under their names before transformers 5 (Granite 4.0-H's and Nemotron-H's configs) -> today's
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}
# released multimodal model_types -> the family of the text model the converter keeps (its config under
# `text_config`; each family's `sanitize` maps its tensor names and drops the vision side)
MULTIMODAL: dict[str, str] = {"llama4": "llama4_text", "qwen3_5_moe": "qwen3_5_moe_text", "kimi_k25": "deepseek_v3",
                              "qwen3_vl_moe": "qwen3_vl_moe_text", "glm4v_moe": "glm4v_moe_text",
                              "gemma4": "gemma4_text", "minimax_m3_vl": "minimax_m3_vl_text",
                              "ernie4_5_vl_moe": "ernie4_5_vl_moe_text",
                              "qwen3_omni_moe": "qwen3_omni_moe_text", "qwen3_omni_moe_thinker": "qwen3_omni_moe_text",
                              "aria": "aria_text"}


def text_model_name(name: str) -> str | None:
    """A released multimodal checkpoint's tensor name as its text model's (`model.language_model.X` -> `model.X`);
    None for the vision tower's (`model.visual.`, `visual.`), which the converter drops."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def multimodal_text(cfg: dict) -> dict | None:
    """A released multimodal config's text model config: `text_config`, or under `thinker_config` (Qwen3-Omni's,
    beside its talker's); None where there is none."""
    inner = cfg.get("thinker_config") if isinstance(cfg.get("thinker_config"), dict) else cfg
    return inner["text_config"] if isinstance(inner.get("text_config"), dict) else None


def text_model_config(cfg: dict) -> dict:
    """A released multimodal config as its text model's own config; a quantization_config or
    tie_word_embeddings at the top (where those folders keep them) stays with it."""
    inner = multimodal_text(cfg)
    text = {**inner, "model_type": MULTIMODAL[cfg["model_type"]]}
    for key in ("quantization_config", "tie_word_embeddings"):
        if cfg.get(key) is not None and key not in inner:
            text[key] = cfg[key]
    return text


@dataclasses.dataclass
class BaseArgs:
    aliases: ClassVar[dict[str, str]] = {}  # other spellings of a field seen in configs (v4 vs v5 names)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BaseArgs:
        """Keep the keys this family knows; `__post_init__` derives the rest."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = {cls.aliases.get(k, k): v for k, v in d.items()} | {k: v for k, v in d.items() if k in names}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        if "raw" in names:  # families that need derived fields read the full config
            kw["raw"] = d
        return cls(**kw)


def refuse(family: str, field: str, value, want: str) -> NoReturn:
    """A config value a family's `check_config` does not implement, named with the family and the field."""
    raise ColibriError(f"{family}: {field}={value!r} is not supported ({want})")


def rename_first(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first of `renames`' (old, new) substrings it contains replaced (a family's `sanitize` map)."""
    for old, new in renames:
        if old in name:
            return name.replace(old, new)
    return name


def check_act_and_rope(family: str, cfg: dict, act: bool = True) -> None:
    """The refusals most families share: an activation other than silu (`act`), an unimplemented RoPE scaling."""
    if act and cfg.get("hidden_act", "silu") != "silu":
        refuse(family, "hidden_act", cfg["hidden_act"], "only silu")
    scaling = rope_scaling(cfg)
    if scaling is not None and scaling["rope_type"] not in ROPE_TYPES:
        refuse(family, "rope_scaling.rope_type", scaling["rope_type"], f"supported: default, {', '.join(ROPE_TYPES)}")


def build(model_type: str, config: dict) -> tuple[nn.Module, Any]:
    """Instantiate a family's model skeleton (placeholders only: cheap, no big tensors)."""
    return family(model_type).build(config)


class CausalLM(nn.Module):
    """Embedding -> decoder blocks -> norm -> lm_head. Blocks take `(h [T, H], LayerKV)`."""

    def __init__(self, vocab: int, hidden: int, eps: float, blocks: list[nn.Module]):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(blocks)
        self.model.norm = RMSNorm(hidden, eps)
        self.lm_head = Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, batch: StepBatch, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [T]: the step's rows (see layers/batch.py) -> logits [T, V] f32, or [len(out_rows), V]
        for just those rows. The readable reference of a step; the engine runs its decode plan
        (engine/decode_plan.py), which takes this path where its native backend does not apply."""
        h = self.embed(tokens)  # [T, H]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, batch.layer(i))
        return self.logits(h if out_rows is None else h[out_rows])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)  # [T, H]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and head over the last layer's rows h [R, H] -> f32 [R, V]."""
        return self.finish(self.lm_head(self.model.norm(h)).float())

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """What a family does to the head's f32 logits [R, V] (nothing here; SoftCapped caps them)."""
        return logits

    def make_cache(self, max_len: int, dtype: torch.dtype, device: str = "cpu", types: KVTypes = DEFAULT) -> list:
        """A slot's caches, one a layer; `types`: the K/V storage (layers/kvquant.py), which a recurrent state
        ignores and a cache that cannot take it refuses in one line."""
        return [layer.self_attn.make_cache(max_len, dtype, device, types) for layer in self.model.layers]

    def cache_cost(self, dtype: torch.dtype, types: KVTypes = DEFAULT) -> tuple[int, int]:
        """A slot's bytes as (per context position, fixed): K/V grow with the context, a linear-attention
        layer's state does not. Measured on the meta device (nothing allocated) at a long context, so that
        what only long contexts cache (DeepSeek-V3.2's indexer keys past index_topk) is counted."""
        n = 1 << 20
        a, b = (sum(c.nbytes for c in self.make_cache(m, dtype, "meta", types)) for m in (n, n + 64))
        return (b - a) // 64, a - n * ((b - a) // 64)

    weights_version = 0  # counts moves of the weights: a decode plan built before one rebuilds

    def _apply(self, fn, recurse: bool = True):  # moved weights: the decode plan's native pointers are stale
        self.weights_version += 1
        return super()._apply(fn, recurse)


class SoftCapped:
    """A CausalLM whose logits are soft-capped: tanh(z / c) c, c = `args.final_logit_softcapping` (None: no cap)."""

    def finish(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V] f32
        cap = self.args.final_logit_softcapping  # type: ignore[attr-defined]
        return torch.tanh(logits / cap) * cap if cap else logits


# ----------------------------------------------------------------------------- binding

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def expected_tensors(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{canonical name: (kind, shape)} the model needs; kind is linear|embedding|param|experts."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, Linear):
            out[f"{mname}.weight"] = ("linear", (mod.out_features, mod.in_features))
            if mod.bias:
                out[f"{mname}.bias"] = ("param", (mod.out_features,))
        elif isinstance(mod, Embedding):
            out[f"{mname}.weight"] = ("embedding", (mod.num_embeddings, mod.dim))
        elif isinstance(mod, SwitchGLU):
            # (E, I, H, gate_up's rows per channel: 2, or 1 for ungated experts)
            out[mname] = ("experts", (mod.num_experts, mod.intermediate, mod.hidden, 2 if mod.gated else 1))
    for pname, p in model.named_parameters():
        out[pname] = ("param", tuple(p.shape))
    return out


def bind(model: nn.Module, store) -> None:
    """Swap placeholders for the store's weights and fill parameters; strict on names and shapes."""
    for mname, mod in list(model.named_modules()):
        if isinstance(mod, Linear):
            q = store.linear(mname, bias=mod.bias)
            if (q.out_features, q.in_features) != (mod.out_features, mod.in_features):
                raise ColibriError(f"{mname}: shape {(q.out_features, q.in_features)} in the file, model expects "
                                   f"{(mod.out_features, mod.in_features)}")
            parent, attr = _parent(model, mname)
            setattr(parent, attr, q)
        elif isinstance(mod, Embedding):
            w = store.tensor(f"{mname}.weight")
            if tuple(w.shape) != (mod.num_embeddings, mod.dim):
                raise ColibriError(f"{mname}: shape {tuple(w.shape)} in the file, model expects "
                                   f"{(mod.num_embeddings, mod.dim)}")
            mod.weight = w
        elif isinstance(mod, SwitchGLU):
            mod.source = store.experts(mname, mod)
    for pname, p in list(model.named_parameters()):
        t = store.tensor(pname)
        if tuple(t.shape) != tuple(p.shape):
            raise ColibriError(f"{pname}: shape {tuple(t.shape)} in the file, model expects {tuple(p.shape)}")
        p.data = t.to(p.dtype)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    head, _, attr = name.rpartition(".")
    return (model.get_submodule(head) if head else model), attr

