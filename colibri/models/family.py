"""The interface every family implements, and how families are found.

A family is a module `colibri/models/<model_type>.py` that ends with one declaration,
`FAMILY = Family("<model_type>", ModelArgs, Model, ...)`, naming its config dataclass, its model and whichever
conversion hooks it needs; every hook not given has the default below (a checkpoint already in the canonical
layout). Declaring a Family registers it, so the families are the modules of this package that declare one:
there is no list of names to keep beside the files.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import ColibriError

# model_types whose checkpoints are another family's layout: Kimi-K2 is DeepSeek-V3's
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}

_REGISTRY: dict[str, Family] = {}


def expert_record(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Default expert layout: gate_up = [gate rows; up rows] ([2I, H]) (an ungated expert's up rows alone, [I, H]),
    down [H, I]."""
    gate_up = parts["gate_up"] if "gate_up" in parts else parts["up"] if "gate" not in parts \
        else torch.cat([parts["gate"], parts["up"]], 0)
    return {"gate_up.weight": gate_up, "down.weight": parts["down"]}


def _accept(cfg: dict) -> None:
    """No refusals beyond the shared ones (colibri/format/validate.py)."""


def _same_config(cfg: dict) -> dict:
    return cfg


def _same_name(name: str) -> str | None:
    return name


def _same_source(st: Any, cfg: dict) -> Any:
    return st


def _same_tensor(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    return t


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: what builds it and what the converter does to its checkpoints."""

    name: str  # the config's model_type
    args: type  # its ModelArgs (a models.base.BaseArgs): the config fields it reads
    model: type  # its Model (a models.base.CausalLM), built from `args`
    # The family's own config refusals, after the shared checks (raise ColibriError, e.g. via base.refuse).
    check_config: Callable[[dict], None] = _accept
    # A nested released config as the flat fields every family reads (DBRX's); the container keeps the flat one.
    flat_config: Callable[[dict], dict] = _same_config
    # A checkpoint's tensors as the converter reads them: split, reshaped or hidden (DBRX's fused Wqkv).
    source_view: Callable[[Any, dict], Any] = _same_source
    # A checkpoint tensor name -> the canonical name the model binds; None drops the tensor.
    sanitize: Callable[[str], str | None] = _same_name
    # A non-expert tensor's values remapped as converted (name, tensor, config) -> tensor (ERNIE's RoPE rows).
    prepare: Callable[[str, torch.Tensor, dict], torch.Tensor] = _same_tensor
    # One expert's parts ({"gate", "up", "down"} or {"gate_up", "down"}, biases) -> the canonical record.
    expert_record: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = expert_record
    # Canonical names dropped where the model has no such tensor (weights the family computes itself).
    ignored: re.Pattern | None = None
    # Multi-token-prediction layers past the decoder stack where the config does not count them (dropped, or kept
    # where the family has an `mtp_config`).
    mtp_layers: int = 0
    # The config that builds the family's MTP decoder layer as layer 0 of a one-layer model (layers/mtp.py); None:
    # the converter drops the MTP layers.
    mtp_config: Callable[[dict], dict] | None = None
    # The MTP layers end with the model's own final norm, having none of their own (ERNIE-4.5's): the converter
    # stores that norm as each one's `norm`.
    mtp_model_norm: bool = False

    def __post_init__(self):
        if _REGISTRY.setdefault(self.name, self) is not self:
            raise ValueError(f"two families declare the model_type '{self.name}'")

    def build(self, config: dict) -> tuple[Any, Any]:
        """The model skeleton (placeholders only: cheap, no big tensors) and its args."""
        args = self.args.from_dict(config)
        return self.model(args), args


def _modules() -> list[str]:
    """The modules of this package, listed without importing them."""
    return [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])]


def supported() -> tuple[str, ...]:
    """Every family's model_type, sorted (imports every module of the package once)."""
    for name in _modules():
        importlib.import_module(f"{__package__}.{name}")
    return tuple(sorted(_REGISTRY))


def family(model_type: str) -> Family:
    """The family of a model_type (an alias resolved); a clear error naming what is supported otherwise."""
    name = ALIASES.get(model_type, model_type)
    if name not in _REGISTRY and name in _modules():  # only the one module needed is imported
        importlib.import_module(f"{__package__}.{name}")
    if name not in _REGISTRY:
        raise ColibriError(f"unsupported model_type '{model_type}' (supported: {', '.join(supported())})")
    return _REGISTRY[name]
