"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's Multi-head Latent Attention and sigmoid router under
GLM's names and defaults. The layers are DeepSeek-V3's (deepseek_v3.py: the MLA latent cache, the
bias-corrected group-limited router, a shared expert); only the config differs:

- Which layers are MoE comes from `mlp_layer_types` ("dense" / "sparse" per layer); without it the first
  layer is dense and the rest sparse -- transformers' rule, which ignores `first_k_dense_replace`. A config
  whose `first_k_dense_replace` contradicts that is refused rather than guessed.
- RoPE rotates the `qk_rope_head_dim` channels, interleaved unless `rope_interleave` is false; a
  `partial_rotary_factor` other than 1 (GLM-4.5's half-head rule) is refused: in transformers it would
  shorten the latent RoPE part, which no released checkpoint does.
- The multi-token-prediction layer (`num_nextn_predict_layers`, appended as layer `num_hidden_layers`,
  GLM-4.5's names) is kept (layers/mtp.py, `mtp_config`: an MoE layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import deepseek_v3 as v3
from .base import refuse
from .family import Family

NAME = "glm4_moe_lite"


@dataclass
class ModelArgs(v3.ModelArgs):
    aliases = {"num_local_experts": "n_routed_experts"}

    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    mlp_layer_types: list | None = None

    def is_moe(self, i: int) -> bool:
        return self.n_routed_experts > 0 and layer_types(self.mlp_layer_types, self.num_hidden_layers)[i] == "sparse"


def layer_types(given: list | None, n_layers: int) -> list[str]:
    """Per layer "dense" or "sparse", as transformers' Glm4MoeLiteConfig decides."""
    return list(given) if given is not None else ["dense"] + ["sparse"] * (n_layers - 1)


class Model(v3.Model):
    pass


def check_config(cfg: dict) -> None:
    v3.check_config(cfg)
    n = int(cfg.get("num_hidden_layers") or 0)
    types = layer_types(cfg.get("mlp_layer_types"), n)
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        refuse(NAME, "mlp_layer_types", cfg.get("mlp_layer_types"), f'{n} entries of "dense" or "sparse"')
    k = cfg.get("first_k_dense_replace")
    if k is not None and cfg.get("mlp_layer_types") is None and n > 1 and k != 1:
        refuse(NAME, "first_k_dense_replace", k,
               "transformers makes only layer 0 dense without mlp_layer_types: give mlp_layer_types")
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        refuse(NAME, "partial_rotary_factor", factor, "only 1.0: RoPE on all qk_rope_head_dim channels")


def mtp_config(cfg: dict) -> dict:
    """The MTP layer (routed experts) as layer 0 of a one-layer model."""
    return {**cfg, "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "first_k_dense_replace": None}


FAMILY = Family(NAME, ModelArgs, Model, check_config=check_config, mtp_config=mtp_config)
