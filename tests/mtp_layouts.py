"""How each family's release ships its multi-token-prediction layer, for tests/test_spec_mtp.py: a tiny transformers
model of L + STEP layers is built (`big_kwargs`), its config cut to the L main layers and given the family's MTP
fields (`main_config`), and its last STEP layers moved under the release's MTP names beside the layer's own input
projection and norms (`ship`). The test then reads the checkpoint as any release."""

from __future__ import annotations

import torch

L = 3  # main layers; the MTP layer is the tiny model's layer L (Nemotron-H's step: layers L and L + 1)

# where a family's checkpoints ship the MTP layer: as layer `num_hidden_layers` (DeepSeek-V3's layout), under `mtp.`
# (Qwen3-Next's), under `model.mtp.layers.{j}` (MiMo-V2-Flash's; MiniMax-M3's with its layer under
# `transformer_layer`), `model.mtp.` (LongCat-Flash's: one MLA and one MLP of its layer), `model.mtp_*.0`
# (ERNIE-4.5's, whose norm is the model's) or `mtp.layers.{i}` (Nemotron-H's step of two layers)
LAYOUT = {"deepseek_v3": "layer", "glm4_moe": "layer", "glm4_moe_lite": "layer", "glm4v_moe_text": "layer",
          "deepseek_v32": "layer", "glm_moe_dsa": "layer", "hy_v3": "layer", "bailing_hybrid": "layer",
          "qwen3_next": "qwen", "qwen3_5_moe_text": "qwen", "exaone_moe": "qwen", "mellum": "qwen",
          "mimo_v2_flash": "mimo", "minimax_m3_vl_text": "minimax", "longcat_flash": "longcat",
          "ernie4_5_moe": "ernie", "nemotron_h": "nemotron"}
STEP = {"nemotron_h": 2}  # (the layers of one MTP step: Nemotron-H's, an attention layer then an MoE one)
# (their norms, the MTP layer's own included, apply 1 + w)
ZERO_CENTRED = ("qwen3_next", "qwen3_5_moe_text", "minimax_m3_vl_text")
DENSE = ("mimo_v2_flash", "exaone_moe", "longcat_flash", "ernie4_5_moe")  # (an MTP layer whose MLP is dense)
# (families whose quantized layers run layer by layer, not in the native whole step: no exact verify, no drafts;
# MiniMax-M3's where a context is long enough to select blocks)
PER_LAYER = ("qwen3_next", "qwen3_5_moe_text", "longcat_flash", "bailing_hybrid", "minimax_m3_vl_text", "nemotron_h")
# the config field that counts the MTP layers (None: the family's own count, its config having none)
COUNT = {"mellum": "num_mtp_layers", "minimax_m3_vl_text": "num_mtp_modules", "hy_v3": None, "longcat_flash": None,
         "qwen3_next": "mtp_num_hidden_layers", "qwen3_5_moe_text": "mtp_num_hidden_layers",
         "exaone_moe": "mtp_num_hidden_layers"}
# LongCat's MTP layer: one of its layer's MLA and MLP sublayers (the module's names -> the checkpoint's)
LONGCAT = {"self_attn.0.": "self_attn.", "mlps.0.": "transformer_layer.mlp.", "input_layernorm.0.": "input_layernorm.",
           "post_attention_layernorm.0.": "post_attention_layernorm."}


def layers(model_type: str, n: int) -> dict:
    """A config's layer count (LongCat's layers hold two attention sublayers: transformers counts those)."""
    return {"num_layers": n, "num_hidden_layers": 2 * n} if model_type == "longcat_flash" else {"num_hidden_layers": n}


def big_kwargs(model_type: str, tiny: dict) -> dict:
    """The tiny config's fields for the (L + STEP)-layer model whose last layers are the MTP layer's kind."""
    types, mlps = tiny.get("layer_types"), tiny.get("mlp_layer_types")
    more = {"layer_types": [*types, "full_attention"]} if LAYOUT[model_type] == "qwen" and types else {}
    more |= {"mlp_layer_types": [*mlps, "sparse"]} if mlps else {}  # (routed, unless said below)
    dense_last = ["dense"] + ["sparse"] * (L - 1) + ["dense"]
    more |= {
        "mimo_v2_flash": {"layer_types": ["full_attention"] + ["sliding_attention"] * L, "mlp_layer_types": dense_last},
        "exaone_moe": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                       "mlp_layer_types": dense_last},  # (sliding with RoPE; the full layers NoPE)
        "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "full_attention", "moe"]},
        "minimax_m3_vl_text": {"layer_types": [*(types or []), "minimax_m3_sparse"], "mlp_layer_types": [*(mlps or []),
                                                                                                         "sparse"]},
        "mellum": {"layer_types": [*(types or []), "sliding_attention"]},  # (what a config naming no kinds gets)
        "bailing_hybrid": {"layer_types": ["linear_attention", "linear_attention", "full_attention", "full_attention"]},
        "ernie4_5_moe": {"moe_layer_end_index": L - 1},  # (dense, as the one-layer model's layer 0)
    }.get(model_type, {})
    more |= {"indexer_types": [*tiny["indexer_types"], "full"]} if "indexer_types" in tiny else {}  # (GLM-5's)
    # a sparse attention keeping every position of these contexts: the one-call step and the true-context reference
    # apply as for V3 (a verify's selection past index_topk: test_speculative.py)
    more |= {"index_topk": 64} if "index_topk" in tiny else {}
    return {**layers(model_type, L + STEP.get(model_type, 1)), **more}


def main_config(model_type: str, cfg: dict) -> None:
    """The saved config cut to the L main layers, with the family's MTP fields (in place)."""
    count = COUNT.get(model_type, "num_nextn_predict_layers")
    cfg.update(**layers(model_type, L), **({count: 1} if count else {}))
    if model_type == "exaone_moe":
        cfg["mtp_layer_types"] = ["sliding_attention"]
    if model_type == "nemotron_h":
        cfg["mtp_layers_block_type"] = ["full_attention", "moe"]
    for key in ("layer_types", "mlp_layer_types", "indexer_types", "layers_block_type"):  # (per-layer lists)
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:L]


def ship(model_type: str, st: dict, own: dict, head: torch.Tensor, embed: torch.Tensor) -> dict:
    """The MTP layer as the family's release names it, from the tiny model's weights `st` (its last layers popped
    from it), the layer's own weights by role, and the model's head and embedding (copies some releases carry)."""
    layout, p = LAYOUT[model_type], f"model.layers.{L}."

    def moved(prefix: str, rename=lambda rest: rest) -> dict:
        return {prefix + rename(k.removeprefix(p)): st.pop(k) for k in list(st) if k.startswith(p)}

    if layout == "qwen":  # the layer under mtp.layers.0, its input projection and norms beside it
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "norm": "norm"}
        return moved("mtp.layers.0.") | {f"mtp.{names[k]}.weight": v for k, v in own.items()}
    if layout == "mimo":  # under model.mtp.layers.0, its post-attention norm renamed
        q = "model.mtp.layers.0."
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "final_layernorm"}
        return moved(q, lambda r: r.replace("post_attention_layernorm", "pre_mlp_layernorm")) | {
            f"{q}{names[k]}.weight": v for k, v in own.items()}
    if layout == "minimax":  # under model.mtp.layers.0.transformer_layer
        q = "model.mtp.layers.0."
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "final_layernorm"}
        return moved(q + "transformer_layer.") | {f"{q}{names[k]}.weight": v for k, v in own.items()}
    if layout == "ernie":  # under model.mtp_block.0; no norm of its own (the model's)
        names = {"enorm": "mtp_emb_norm", "hnorm": "mtp_hidden_norm", "eh_proj": "mtp_linear_proj"}
        return moved("model.mtp_block.0.") | {f"model.{names[k]}.0.weight": own[k] for k in names}
    if layout == "nemotron":  # layers L, L + 1 under mtp.layers.0 / 1, the own weights on the step's ends
        step = STEP[model_type]
        out = {f"mtp.layers.{i}.{k.removeprefix(f'backbone.layers.{L + i}.')}": st.pop(k) for i in range(step)
               for k in list(st) if k.startswith(f"backbone.layers.{L + i}.")}
        names = {"enorm": "0.enorm", "hnorm": "0.hnorm", "eh_proj": "0.eh_proj", "norm": f"{step - 1}.final_layernorm"}
        return out | {f"mtp.layers.{names[k]}.weight": v for k, v in own.items()}
    if layout == "longcat":  # layer L's first MLA and MLP under model.mtp.layers.0 (the rest of it goes)
        out = {f"model.mtp.layers.0.{dst}{k.removeprefix(p + src)}": st[k] for k in st for src, dst in LONGCAT.items()
               if k.startswith(p + src)}
        for k in [k for k in st if k.startswith(p)]:
            del st[k]
        names = {"enorm": "layers.0.enorm.m", "hnorm": "layers.0.hnorm.m", "eh_proj": "layers.0.eh_proj",
                 "norm": "norm"}
        return out | {f"model.mtp.{names[k]}.weight": v for k, v in own.items()} | {
            "model.mtp.embed_tokens.weight": embed}
    # DeepSeek's: the layer stays as layer L, its own beside it (Hy3's and Ling's name their norm final_layernorm,
    # Hy3's its copy of the head shared_head.weight)
    final = "final_layernorm" if model_type in ("hy_v3", "bailing_hybrid") else "shared_head.norm"
    names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": final}
    return {f"{p}{names[k]}.weight": v for k, v in own.items()} | {
        p + ("shared_head.weight" if model_type == "hy_v3" else "shared_head.head.weight"): head,
        p + "embed_tokens.weight": embed}
