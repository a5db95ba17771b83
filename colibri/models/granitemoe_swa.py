"""IBM Granite's sliding-window MoE (`granitemoe_swa`: granite-swash-3b-a600m): the layers of granitemoeshared.py
(Granite's multipliers, a shared expert) with gpt-oss-like attention:

- `layer_types`: sliding layers attend over the last `sliding_window` positions (default: every 4th layer full,
  from layer 0; the rest slide);
- a learned per-head sink logit joins every layer's softmax denominator (`self_attn.sinks`);
- `layer_rope_theta`: each layer's RoPE base, 0 for none (NoPE); the global base where absent.

The attention block, the MoE block with the shared expert and the one-call step take all of it at int8 / int4.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..format.validate import is_number
from ..layers.attention import AttentionArgs
from . import granitemoe, granitemoeshared
from .base import refuse
from .family import Family

NAME = "granitemoe_swa"
sanitize, source_view, prepare = granitemoeshared.sanitize, granitemoeshared.source_view, granitemoeshared.prepare
KINDS = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs(granitemoeshared.ModelArgs):
    sliding_window: int | None = 128
    layer_types: list | None = None
    layer_rope_theta: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = [KINDS[bool(i % 4)] for i in range(self.num_hidden_layers)]


class Model(granitemoeshared.Model):
    @classmethod
    def attention_args(cls, a: ModelArgs, i: int) -> AttentionArgs:
        args = super().attention_args(a, i)
        theta = a.layer_rope_theta[i] if a.layer_rope_theta else args.positions.rope_theta
        window = a.sliding_window if a.layer_types[i] == "sliding_attention" else None
        # (a NoPE layer keeps a valid base: its table is built but not applied)
        positions = dataclasses.replace(args.positions, use_rope=theta != 0,
                                        rope_theta=theta or args.positions.rope_theta)
        return dataclasses.replace(args, positions=positions,
                                   scores=dataclasses.replace(args.scores, sliding_window=window, sinks=True))


def check_config(cfg: dict) -> None:
    """Granite's refusals, and layer lists that do not name one valid entry per layer."""
    granitemoe.check_config(cfg)
    n = cfg.get("num_hidden_layers")
    kinds, thetas = cfg.get("layer_types"), cfg.get("layer_rope_theta")
    if kinds is not None and (len(kinds) != n or any(k not in KINDS for k in kinds)):
        refuse(NAME, "layer_types", kinds, f"{n} entries of {' / '.join(KINDS)}")
    if thetas is not None and (len(thetas) != n or not all(is_number(t) and t >= 0 for t in thetas)):
        refuse(NAME, "layer_rope_theta", thetas, f"{n} numbers >= 0 (0: no RoPE)")
    if any(k == "sliding_attention" for k in kinds or KINDS) and not cfg.get("sliding_window", 128):
        refuse(NAME, "sliding_window", cfg.get("sliding_window"), "a window of at least 1 for the sliding layers")


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, source_view=source_view, sanitize=sanitize,
                prepare=prepare)
