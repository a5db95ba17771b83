"""Multi-token-prediction (MTP) layers: the extra decoder layer DeepSeek-V3/V3.2, GLM-4.5/4.7/5, Hy3, Ling 3.0 hybrid,
Qwen3-Next/3.5, K-EXAONE, Mellum, LongCat-Flash, MiniMax-M3, Nemotron-H, ERNIE-4.5 and MiMo-V2-Flash ship.

Such a layer predicts the token after next: from the main model's final hidden state at position i (after its final
norm) and the embedding of token i + 1, e = enorm(embed(t_{i+1})), h = hnorm(h_i), it runs one decoder layer of the
family over eh_proj([e; h]) at position i (its own K/V over the earlier positions) and the model's head after its
own norm (`shared_head.norm`). Chained on its own output (the layer's output before that norm as the next h), it
drafts further tokens (engine/mtp.py).

Stored in the container under `mtp.{j}.` (the converter keeps it where the family knows its one-layer config,
`Family.mtp_config`): `block.*` (the decoder layer; `block1.*`, ... where one step runs several: Nemotron-H's),
`enorm`, `hnorm`, `eh_proj`, `norm`. Checkpoints ship it in several layouts, which each family's `sanitize` maps
(docs/MODELS.md lists them): as layer `num_hidden_layers` (DeepSeek-V3's: `canonical`; its copies of the embedding
and head, `embed_tokens` and `shared_head.head`, are the main model's and are not kept), under `mtp.` (Qwen3-Next's:
`qwen_canonical`: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.{j}, norm), or under roots of their own
(MiMo-V2-Flash's, MiniMax-M3's, LongCat-Flash's, ERNIE-4.5's, Nemotron-H's). Where the MTP layer is not one of the
family's own layers, the config `mtp_config` gives makes the family build it (LongCat's plain MLA layer); where it
has no norm of its own, the converter stores the model's as its (`Family.mtp_model_norm`: ERNIE-4.5's). `View`
presents one MTP layer as a one-layer model's container (`model.layers.0.*`, `model.norm`), so the tiered store, the
placement and the K/V slots treat it as any model; the main model's store never reads `mtp.*`.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import nn

from ..errors import ColibriError
from ..models.family import family
from .layers import Linear, RMSNorm

PREFIX = "mtp."  # the container's MTP tensors and records
_INPUT = ("enorm.", "hnorm.", "eh_proj.")  # the layer's own input projection, stored as is
# the main model's embedding and head, copied into the checkpoint (Hy3's head as `shared_head.weight`)
_SHARED = ("embed_tokens.", "shared_head.head.", "shared_head.weight")
_NORM = ("shared_head.norm.", "final_layernorm.")  # the layer's own norm (DeepSeek's name; Hy3's, Ling's, MiMo's)


def present(header: dict) -> bool:
    """Whether a container's header holds an MTP layer."""
    return any(n.startswith(PREFIX) for n in header["tensors"])


def kept(model_type: str, cfg: dict) -> int:
    """MTP layers a container of this family and config carries (0 where the family has no MTP config)."""
    fam = family(model_type)
    # (DeepSeek's count, Qwen's, transformers' MtpModel's; else the family's own where its config names none: Hy3's)
    n = cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or cfg.get("num_mtp_layers") \
        or cfg.get("num_mtp_modules") or fam.mtp_layers  # (MiniMax-M3's last)
    return int(n) if fam.mtp_config is not None else 0


def canonical(rest: str, j: int) -> str | None:
    """The container name of one MTP layer's checkpoint tensor (`rest`: its name after `model.layers.{N + j}.`);
    None for the shared embedding and head."""
    if rest.startswith(_SHARED):
        return None
    if rest.startswith(_INPUT):
        return f"{PREFIX}{j}.{rest}"
    for norm in _NORM:
        if rest.startswith(norm):
            return f"{PREFIX}{j}.norm.{rest.removeprefix(norm)}"
    return f"{PREFIX}{j}.block.{rest}"


_QWEN = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "norm.": "norm."}


def qwen_canonical(rest: str) -> str | None:
    """The container name of a Qwen3-Next / Qwen3.5 MTP tensor (`rest`: its name after `mtp.`); None for what the
    layout does not hold."""
    if rest.startswith("layers."):
        j, _, sub = rest.removeprefix("layers.").partition(".")
        return f"{PREFIX}{j}.block.{sub}" if j.isdigit() else None
    for src, dst in _QWEN.items():
        if rest.startswith(src):
            return f"{PREFIX}0.{dst}{rest.removeprefix(src)}"  # (one MTP layer: its input projection and norm)
    return None


_BLOCK = re.compile(r"block(\d*)\.(.+)")  # (a step of several layers: block., block1., ...)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _to_view(name: str, j: int) -> str | None:
    """A container name -> its name in MTP layer j's view (None: not that layer's)."""
    p = f"{PREFIX}{j}."
    if not name.startswith(p):
        return None
    rest = name[len(p) :]
    if m := _BLOCK.fullmatch(rest):
        return f"model.layers.{m[1] or 0}.{m[2]}"
    if rest.startswith("norm."):
        return "model." + rest
    return rest


def _from_view(name: str, j: int) -> str:
    if m := _LAYER.fullmatch(name):
        return f"{PREFIX}{j}.block{m[1] if m[1] != '0' else ''}.{m[2]}"
    if name.startswith("model.norm."):
        return f"{PREFIX}{j}." + name.removeprefix("model.")
    return f"{PREFIX}{j}.{name}"


class MTPModel(nn.Module):
    """One MTP layer as a one-layer model: `model.layers[0]` (the family's decoder layer), `model.norm`, and the
    input projection. The embedding and head are the main model's (engine/mtp.py runs it with them)."""

    def __init__(self, inner: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.model = inner.model
        self.model.embed_tokens = None  # (the main model's)
        self.args = getattr(inner, "args", None)
        self.make_cache = inner.make_cache
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)

    def inputs(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The layer's input [T, H] from the next tokens' embeddings e [T, H] and the hidden states h [T, H]."""
        x = torch.cat([self.enorm(e), self.hnorm(h.to(e.dtype))], -1)  # [T, 2H]
        return self.eh_proj(x)


def config(model_type: str, cfg: dict) -> dict:
    """The one-layer config that builds the family's MTP decoder layer as layer 0."""
    fam = family(model_type)
    if fam.mtp_config is None:
        raise ColibriError(f"{model_type}: colibri does not run this family's multi-token-prediction layers")
    return fam.mtp_config(copy.deepcopy(cfg))


def build(model_type: str, cfg: dict) -> MTPModel:
    """The skeleton of one MTP layer (placeholders only)."""
    sub = config(model_type, cfg)
    inner, args = family(model_type).build(sub)
    del inner.lm_head
    # (the model's own norm says its epsilon, whatever the config calls it: Nemotron-H's layer_norm_epsilon)
    eps = float(getattr(inner.model.norm, "eps", None) or getattr(args, "rms_norm_eps", None) or 1e-6)
    return MTPModel(inner, int(sub["hidden_size"]), eps)


def expected(model_type: str, cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{container name: (kind, shape)} of the MTP layers a container keeps (the converter's plan)."""
    from ..models.base import expected_tensors

    n = kept(model_type, cfg)
    if not n:
        return {}
    one = expected_tensors(build(model_type, cfg))
    return {_from_view(name, j): v for j in range(n) for name, v in one.items()}


class View:
    """A container's MTP layer j as a one-layer model's container: the same file, its names mapped
    (`model.layers.0.*`, `model.norm.*`, `enorm`...), the config of `config`. Read-only, shares the file."""

    def __init__(self, c, j: int = 0):
        self.base_of = {v: n for n in c.header["tensors"] if (v := _to_view(n, j)) is not None}  # view -> file name
        if not self.base_of:
            raise ColibriError(f"{c.path} has no multi-token-prediction layer (the checkpoint ships none, colibri "
                               "does not run this family's, or it was converted with --no-mtp)")
        self.record_of = {v: n for n in c.header["records"] if (v := _to_view(n, j)) is not None}
        self.j = j
        tensors = {v: c.header["tensors"][n] for v, n in self.base_of.items()}
        records = {v: self._mapped(c.header["records"][n]) for v, n in self.record_of.items()}
        self.meta = {**c.meta, "config": config(c.model_type, c.config)}
        self.header: dict[str, Any] = {**c.header, "tensors": tensors, "records": records, "meta": self.meta}
        self.path, self.fd, self.base = c.path, c.fd, c

    def _mapped(self, r: dict) -> dict:
        return {**r, "tensors": {sub: _to_view(full, self.j) for sub, full in r["tensors"].items()}}

    # the Container calls the store makes, over the mapped index (the mapping and the file are the base's)
    model_type = property(lambda self: self.base.model_type)
    config = property(lambda self: self.meta["config"])
    quant = property(lambda self: self.base.quant)

    def names(self) -> list[str]:
        return list(self.base_of)

    def has(self, name: str) -> bool:
        return name in self.base_of

    def has_record(self, name: str) -> bool:
        return name in self.record_of

    def fileno(self) -> int:
        return self.fd

    def info(self, name: str) -> dict:
        return self.base.info(self.base_of.get(name, name))

    def tensor(self, name: str) -> torch.Tensor:
        return self.base.tensor(self.base_of.get(name, name))

    def record(self, name: str) -> dict:
        return self._mapped(self.base.record(self.record_of.get(name, name)))

    def record_views(self, name: str, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.base.record_views(self.record_of.get(name, name), buf)

    def close(self) -> None:  # (the base container owns the file)
        pass
