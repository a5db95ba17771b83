"""Decode speed of the families with shared experts, dense layers and attention biases, by path, in one process.

    .venv/bin/python benchmarks/bench_one_call.py [--families qwen2_moe ...] [--scheme int8]
        [--tokens 64] [--rounds 3] [--prefill 128] [--llamacpp] [--workdir /tmp/colibri-one-call] [--keep-sources]

Each family (qwen2_moe, glm4_moe, dots1, ernie4_5_moe, gpt_oss; deepseek_v2 / v3 with MLA attention, whose
block is kernels/mla.c, and deepseek_v3-g8 with V3/R1's 8 router groups; glm4_moe_lite with V3's layers;
llama4_text, hunyuan_v1_moe, exaone_moe, qwen3_next,
qwen3_5_moe_text,
deepseek_v32, glm_moe_dsa, mimo_v2_flash, mistral4, phimoe, solar_open, granitemoe, granitemoe_swa, dbrx,
afmoe, flex_olmo, hy_v3, flint, kolibri1, axk1, mellum, cohere2_moe, laguna, gemma4_text,
lfm2_moe, granitemoehybrid, jamba, nemotron_h, longcat_flash, minimax, kimi_linear, bailing_hybrid, axk2,
beam, minimax_m3_vl_text) gets a random checkpoint of the 0.44b benchmark shape (hidden 1024, 8 layers, 32
experts top-4 of width 512, Llama 4's top-1; its shared expert / dense layer 2048 wide, GLM's and ERNIE's one
shared expert 512; transformers' own initialisation), converted once. The same loaded model
then decodes `--tokens` greedy tokens of one request, rounds interleaved, by:
  one-call   the default: every layer in kernels/step.c's one call, with native runs (engine/runner.py)
  per-layer  the fused blocks and MLP kernel called layer by layer from Python (the decode plan on torch)
  torch-mlp  per layer, with the dense / shared MLPs in torch ops, biased attention unfused, ERNIE's,
             gpt-oss's and DeepSeek's routers, gpt-oss's experts, DeepSeek's MLA attention and Llama 4's
             attention and MoE blocks in torch: the path they took before
With `--llamacpp`, llama.cpp (built from the llama-cpp-python sdist: benchmarks/llamacpp.py) decodes the
same checkpoint as GGUF (Q8_0 for int8, Q4_0 for int4) with llama-bench after colibri's rounds, same
threads and token count. With `--prefill N`, the default path's prefill tok/s of an N-token prompt too (and
llama.cpp's ppN). Printed: tok/s per mode (median of the rounds), the ratios to one-call, llama.cpp's
tok/s and one-call's ratio to it, and the load average. Nothing else should run meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_tiny import make_tiny_checkpoint  # noqa: E402

import colibri  # noqa: E402
from colibri.convert.converter import convert  # noqa: E402
from colibri.engine.threads import DecodeThreads  # noqa: E402
from colibri.kernels import native  # noqa: E402
from colibri.layers import mla, native_mlp  # noqa: E402
from colibri.layers.attention import Attention  # noqa: E402
from colibri.layers.moe import SwitchGLU, silu_glu  # noqa: E402
from colibri.models import deepseek_v2, deepseek_v3, ernie4_5_moe, gpt_oss, llama4_text, mistral4  # noqa: E402

BASE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts_per_tok": 4,
        "max_position_embeddings": 1024}
SHAPES = {
    "qwen2_moe": {**BASE, "num_experts": 32, "shared_expert_intermediate_size": 2048, "mlp_only_layers": []},
    # (one shared expert, as GLM-4.5 and, below, ERNIE: llama.cpp's loaders want the shared width of one expert)
    "glm4_moe": {**BASE, "n_routed_experts": 32, "n_shared_experts": 1, "n_group": 1, "topk_group": 1},
    # (multi-head attention, as the released dots.llm1: llama.cpp's loader wants as many k/v heads as q heads)
    "dots1": {**BASE, "n_routed_experts": 32, "n_shared_experts": 4, "n_group": 1, "topk_group": 1,
              "num_key_value_heads": 16, "scoring_func": "sigmoid"},  # (llama.cpp reads the router rule from it)
    "ernie4_5_moe": {**BASE, "moe_num_experts": 32, "moe_k": 4, "moe_num_shared_experts": 1,
                     "moe_layer_start_index": 1},
    # MLA (attention layer by layer), V2-Lite's greedy router / Moonlight's one-group one: each MoE layer one call
    "deepseek_v2": {**BASE, "n_routed_experts": 32, "n_shared_experts": 2, "first_k_dense_replace": 1,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                    "q_lora_rank": None, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                    "v_head_dim": 64, "num_key_value_heads": 16, "head_dim": 32},
    "deepseek_v3": {**BASE, "n_routed_experts": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                    "v_head_dim": 64, "num_key_value_heads": 16, "head_dim": 32},
    "gpt_oss": {**BASE, "intermediate_size": 512, "num_local_experts": 32, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 4},
    # Scout's layout at this size: top-1 of 32 experts + a shared one in every layer, no RoPE on every
    # fourth (its released chunk, temperature floor and RoPE scaling)
    "llama4_text": {**{k: v for k, v in BASE.items() if k != "moe_intermediate_size"}, "intermediate_size": 512,
                    "intermediate_size_mlp": 2048, "num_local_experts": 32, "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "floor_scale": 8192,
                    "attention_bias": False,  # (as released; llama.cpp's loader has no place for them)
                    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192}},
}
# Hunyuan-A13B's layout: every layer 32 experts top-4 + a shared MLP as wide, q/k norm after RoPE, NTK alpha;
# its heads of 128, context, alpha and per-layer lists as released (llama.cpp's converter asserts them)
SHAPES["hunyuan_v1_moe"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size",
                                                                         "num_experts_per_tok")},
                            "num_attention_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
                            "intermediate_size": 512, "num_experts": 32, "moe_topk": [4] * 8,
                            "num_experts_per_tok": [4] * 8,  # (transformers maps it onto moe_topk)
                            "moe_intermediate_size": [512] * 8, "num_shared_expert": [1] * 8,
                            "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                "rope_theta": 10000.0}}
# GLM-4.7-Flash: DeepSeek-V3's layers, v heads wider than q/k's nope part (256 vs 192 as released), one group
SHAPES["glm4_moe_lite"] = {**SHAPES["deepseek_v3"], "routed_scaling_factor": 1.8, "qk_nope_head_dim": 96,
                           "v_head_dim": 128, "mlp_layer_types": ["dense"] + ["sparse"] * 7,
                           "first_k_dense_replace": 1}  # (llama.cpp's converter reads the latter)
# K-EXAONE: three sliding layers (RoPE) then a full one (no RoPE), q/k norm, layer 0 dense, one shared expert
SHAPES["exaone_moe"] = {**BASE, "num_experts": 32, "num_shared_experts": 1, "first_k_dense_replace": 1,
                        "n_group": 1, "topk_group": 1, "sliding_window": 128, "sliding_window_pattern": 4,
                        "scoring_func": "sigmoid"}  # (llama.cpp reads the router rule from it)
# Qwen3-Next at this size: DeltaNet layers with a full-attention one every fourth (8 heads of 128, a quarter
# rotated), 8 key heads of 16 value heads of 64, a gated shared expert as wide as an expert (its decode step is
# per layer: the linear-attention layers run in torch)
SHAPES["qwen3_next"] = {**BASE, "num_experts": 32, "shared_expert_intermediate_size": 512, "mlp_only_layers": [],
                        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "layer_types": None,
                        "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
                        "linear_value_head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                                         "partial_rotary_factor": 0.25}}
# Qwen3.5 MoE: the same layers with four linear-layer input projections, every layer MoE
SHAPES["qwen3_5_moe_text"] = {**{k: v for k, v in SHAPES["qwen3_next"].items() if k != "mlp_only_layers"},
                              "vocab_size": 512}  # (llama.cpp's converter reads one more token than the tokenizer has)
# DeepSeek-V3.2: V3's layers with the sparse attention's indexer (these contexts stay under index_topk: dense)
SHAPES["deepseek_v32"] = {**SHAPES["deepseek_v3"], "first_k_dense_replace": 1, "index_topk": 2048,
                          "index_head_dim": 64, "index_n_heads": 16}
# GLM-5: V3.2's layers, every other layer sharing its predecessor's selection
SHAPES["glm_moe_dsa"] = {**SHAPES["deepseek_v32"], "indexer_types": ["full", "shared"] * 4}
# MiMo-V2-Flash: q/k heads of 96, values of 64 scaled by 0.707, sliding layers (twice the KV heads, sinks) but
# layers 0 and 5, no shared expert
SHAPES["mimo_v2_flash"] = {**BASE, "n_routed_experts": 32, "head_dim": 96, "v_head_dim": 64, "sliding_window": 128,
                           "n_group": 1, "topk_group": 1, "attention_value_scale": 0.707}
# Mistral Small 4: V3's layers with its softmax router (one group), YaRN and the long-context query scaling
SHAPES["mistral4"] = {**{k: v for k, v in SHAPES["deepseek_v3"].items() if k != "head_dim"},
                      "routed_scaling_factor": 1.0}  # (transformers derives its rotary width from head_dim)
SHAPES["mistral4"]["rope_parameters"] = mistral4.rope_defaults(SHAPES["mistral4"])  # (as released: over 8192)
# Qwen3-VL MoE's and GLM-4.5V's text models, built and saved as the released multimodal checkpoints
# (experts 384 wide: twice that is not the hidden size, which the x @ W layout on disk needs to be unambiguous)
SHAPES["qwen3_vl_moe_text"] = {**BASE, "num_experts": 32, "moe_intermediate_size": 384, "mlp_only_layers": [],
                               "decoder_sparse_step": 1, "rope_parameters": {
                                   "rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12],
                                   "mrope_interleaved": True}}
# ERNIE-4.5-VL's text model: ERNIE-4.5's layers, M-RoPE sections over the 32 frequency pairs (the release's
# [22, 22, 20] over 64), vision experts of another width beside the text ones (dropped at conversion)
SHAPES["ernie4_5_vl_moe_text"] = {**{k: v for k, v in SHAPES["ernie4_5_moe"].items() if k != "moe_layer_start_index"},
                                  "moe_intermediate_size": [BASE["moe_intermediate_size"], 256],
                                  "mlp_layer_types": ["dense"] + ["sparse"] * (BASE["num_hidden_layers"] - 1),
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                      "mrope_section": [12, 12, 8]}}
# Aria's text model: an MoE in every layer with two shared experts of the experts' width (as released), Mixtral's
# router, x @ W experts
SHAPES["aria_text"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size", "intermediate_size")},
                       "intermediate_size": 512, "moe_num_experts": 32, "moe_topk": 4, "moe_num_shared_experts": 2}
# Qwen3-Omni's thinker text model: Qwen3-MoE's layers (the 0.44b shape's 32 experts top-4), interleaved M-RoPE
SHAPES["qwen3_omni_moe_text"] = {**BASE, "num_experts": 32, "mlp_only_layers": [], "decoder_sparse_step": 1,
                                 "norm_topk_prob": True, "rope_parameters": {
                                     "rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12],
                                     "mrope_interleaved": True}}
SHAPES["glm4v_moe_text"] = {**SHAPES["glm4_moe"], "attention_bias": True,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                                "mrope_section": [4, 6, 6]}}
# DeepSeek-V3/R1's group-limited router (8 groups, the best 4 kept: kernels/moe.c keep_groups)
# Phi-3.5-MoE's layout at this size: 16 experts top-2 of width 1024 (the same expert bytes a token reads as the
# others' 4 of 512), LayerNorms, biases, longrope with its 4096-position switch and equal scales as released
SHAPES["phimoe"] = {**{k: v for k, v in BASE.items() if k != "moe_intermediate_size"}, "intermediate_size": 1024,
                    "num_local_experts": 16, "num_experts_per_tok": 2, "attention_bias": True, "lm_head_bias": True,
                    "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 4096, "short_factor": [1.0] * 32,
                                        "long_factor": [1.0 + i / 4 for i in range(32)], "short_mscale": 1.243,
                                        "long_mscale": 1.243}}
# Solar Open: GLM-4.5's MoE layers in every layer (one router group), q/k/v biases, RoPE over the whole head
SHAPES["solar_open"] = {**SHAPES["glm4_moe"], "attention_bias": True}
# Granite 3.x MoE: 32 experts top-4 of 512, the released 3b-a800m's multipliers and tied head
SHAPES["granitemoe"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size", "head_dim")},
                        "intermediate_size": 512, "num_local_experts": 32, "embedding_multiplier": 12.0,
                        "attention_multiplier": 0.015625, "residual_multiplier": 0.22, "logits_scaling": 6.0,
                        "tie_word_embeddings": True}
# Granite's sliding-window MoE: Granite's layers with a shared expert of 1024, sinks, 3 of 4 layers sliding over 128
SHAPES["granitemoe_swa"] = {**SHAPES["granitemoe"], "shared_intermediate_size": 1024, "sliding_window": 128,
                            "layer_types": ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
                            + ["sliding_attention"] * 3, "layer_rope_theta": None}
# Granite 4.0-H (layer by layer: Mamba-2 and attention mixers): Granite's layers with a shared expert of 1024 under
# Mamba-2 layers (32 heads of 64 channels, one group of 128 states, 4 taps) and attention in layers 3 and 7, no RoPE
SHAPES["granitemoehybrid"] = {**SHAPES["granitemoe"], "shared_intermediate_size": 1024,
                              "position_embedding_type": "nope",
                              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
                              "mamba_n_heads": 32, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
                              "mamba_d_conv": 4, "mamba_chunk_size": 256}
# Jamba (layer by layer: Mamba and attention mixers): attention in layer 4 of 8, 16 experts top-2 in the odd layers,
# dense MLPs in the even ones (all 1024 wide: Jamba's experts are its MLP's width), Mamba of 16 states over 2048
# channels (dt rank 64), no RoPE
SHAPES["jamba"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size", "head_dim")},
                   "intermediate_size": 1024, "num_experts": 16, "num_experts_per_tok": 2, "attn_layer_period": 8,
                   "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1}
# Nemotron-H (layer by layer, one sublayer a layer): Mamba-2 / experts / Mamba-2 / experts / attention / experts /
# Mamba-2 / experts (Nemotron 3 Nano's mix in 8 layers); 32 ungated relu^2 experts top-4 of 512 beside a shared one of
# 1024, one router group; Mamba-2 of 32 heads x 64 in 8 groups of 128 states; attention heads of 64, no RoPE
SHAPES["nemotron_h"] = {**{k: v for k, v in BASE.items() if k not in ("intermediate_size",)},
                        "layers_block_type": ["linear_attention", "moe", "linear_attention", "moe", "full_attention",
                                              "moe", "linear_attention", "moe"],
                        "n_routed_experts": 32, "moe_shared_expert_intermediate_size": 1024, "n_group": 1,
                        "topk_group": 1, "mamba_num_heads": 32, "mamba_head_dim": 64, "n_groups": 8,
                        "ssm_state_size": 128, "chunk_size": 256}
# LongCat-Flash (layer by layer: two MLA sublayers, dense MLPs of 2048 and a shortcut MoE a layer): 4 layers, so 8
# attention sublayers as the other shapes; 32 routed experts of 512 and 16 zero-computation ones, top-6 (the release's
# 512 + 256 top-12, halved twice), V3's MLA widths (llama.cpp: no converter)
SHAPES["longcat_flash"] = {**{k: v for k, v in SHAPES["deepseek_v3"].items()
                              if k not in ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                                           "norm_topk_prob", "num_hidden_layers", "intermediate_size",
                                           "moe_intermediate_size", "num_experts_per_tok")},
                           "num_hidden_layers": 8, "num_layers": 4, "n_routed_experts": 32, "zero_expert_num": 16,
                           "routed_scaling_factor": 6.0,
                           # (each width under both its names: transformers' aliases would take the tiny model's)
                           **{k: 2048 for k in ("ffn_hidden_size", "intermediate_size")},
                           **{k: 512 for k in ("expert_ffn_hidden_size", "moe_intermediate_size")},
                           **{k: 6 for k in ("moe_topk", "num_experts_per_tok")}}
# MiniMax-Text-01 / M1 (layer by layer: lightning and softmax attention): seven lightning layers then one full one (the
# release's ratio), 32 experts top-2 of 512 (Mixtral's router), the release's residual weights (alpha 3.5566, beta 1)
SHAPES["minimax"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size",)}, "intermediate_size": 512,
                     "num_local_experts": 32, "num_experts_per_tok": 2, "block_size": 256,
                     "layer_types": ["linear_attention"] * 7 + ["full_attention"],
                     **{f"{k}_alpha_factor": 3.5565588200778455 for k in ("full_attn", "linear_attn", "mlp")},
                     **{f"{k}_beta_factor": 1.0 for k in ("full_attn", "linear_attn", "mlp")}}
# Kimi-Linear (layer by layer: KDA and MLA without RoPE): three KDA layers (16 heads of 128 -- as many as the MLA's,
# as released and as llama.cpp's loader assumes -- 4 taps) then an MLA one,
# twice (the release's 3:1); MLA with V3's widths at this size and no q LoRA (as released); layer 0 dense, then 32
# experts top-4 of 512 beside one shared (one router group)
SHAPES["kimi_linear"] = {**{k: v for k, v in SHAPES["deepseek_v3"].items() if k != "q_lora_rank"}, "q_lora_rank": None,
                         "num_local_experts": 32, "linear_num_heads": 16, "linear_head_dim": 128,
                         "linear_conv_kernel_dim": 4,
                         "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}
# Ling 3.0 hybrid (layer by layer: KDA with full-rank gates and the bounded decay, MLA with a gate per head): three
# KDA layers (16 heads of 128, 4 taps) then a gated MLA one, twice (groups of 4; the release's are 6); MLA with V3's
# widths at this size and no q LoRA (as released); layer 0 dense, then 32 experts top-4 of 512 beside one shared
SHAPES["bailing_hybrid"] = {**{k: v for k, v in SHAPES["deepseek_v3"].items()
                               if k not in ("q_lora_rank", "n_routed_experts", "head_dim")},
                            "num_experts": 32, "head_dim": 128, "layer_group_size": 4,
                            "num_mtp_layers": 0}  # (none: llama.cpp's loader would want its weights)
# Arcee's AFMoE: 32 experts top-4 of 512 beside one shared, layer 0 dense, 3 of 4 layers sliding over 128, muP
SHAPES["afmoe"] = {**{k: v for k, v in BASE.items() if k != "moe_intermediate_size"}, "moe_intermediate_size": 512,
                   "num_experts": 32, "num_shared_experts": 1, "num_dense_layers": 1, "sliding_window": 128,
                   "layer_types": None, "global_attn_every_n_layers": 4, "mup_enabled": True}
# FlexOlmo: OLMoE's layers (32 experts top-4 of 512 here), norms after each sublayer only (llama.cpp: no converter)
SHAPES["flex_olmo"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size", "head_dim")},
                       "intermediate_size": 512, "num_experts": 32}
# Hy3: GLM's MoE layers (32 experts top-4 of 512 beside one shared, one router group, the released scale), layer 0
# dense, per-head q/k norm over the whole head
SHAPES["hy_v3"] = {**BASE, "num_experts": 32, "num_shared_experts": 1, "router_scaling_factor": 2.826,
                   "mlp_layer_types": ["dense"] + ["sparse"] * 7}
# Flint: Qwen3-MoE's layers (32 experts top-4 of 512 beside an ungated shared one of 1024, layers 0 and 1 dense),
# sinks everywhere, its sliding layers (window 128) rotated and its full ones not
SHAPES["flint"] = {**BASE, "num_experts": 32, "shared_expert_intermediate_size": 1024, "sliding_window": 128,
                   "layer_types": None, "mlp_only_layers": [0, 1]}  # (FlintConfig's patterns)
# Kolibri-1: 32 experts top-4 of 512 beside a shared one of 512 in every layer, sliding layers (128) rotated and every
# fifth full one not, each sublayer's output norm, the router choosing by logit + bias
SHAPES["kolibri1"] = {**BASE, "num_experts": 32, "shared_expert_intermediate_size": 512, "sliding_window": 128,
                      "norm_topk_prob": True, "layer_types": None}  # (Kolibri1Config's pattern)
# Mellum 2: Qwen3-MoE's layers (32 experts top-4 of 512), every other layer sliding over 128 with its own RoPE base
SHAPES["mellum"] = {**BASE, "num_local_experts": 32, "sliding_window": 128,
                    "layer_types": ["full_attention", "sliding_attention"] * 4, "mlp_layer_types": ["sparse"] * 8,
                    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
# Command A MoE: parallel blocks (layer by layer), 32 experts top-4 of 512 averaged with a shared one, layer 0 a dense
# prefix layer of 2048, 3 of 4 of the others sliding over 128, the head tied and scaled
SHAPES["cohere2_moe"] = {**{k: v for k, v in BASE.items() if k != "moe_intermediate_size"}, "intermediate_size": 512,
                         "num_experts": 32, "num_shared_experts": 1, "first_k_dense_replace": 1,
                         "prefix_dense_intermediate_size": 2048, "sliding_window": 128, "tie_word_embeddings": True}
# Laguna: 32 experts top-4 of 512 beside a shared one, layer 0 dense, 3 of 4 layers sliding over 128, the default
# RoPE per type, a softplus gate per head
SHAPES["laguna"] = {**BASE, "num_experts": 32, "shared_expert_intermediate_size": 512, "sliding_window": 128,
                    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
                    "num_attention_heads_per_layer": None, "rope_parameters": None}
# Gemma 4 MoE (layer by layer): 32 experts top-4 of 512 beside
# a dense GELU MLP of 768 in every layer (26B-A4B's proportions), five sliding layers (128) to a full one with heads
# twice as wide, 2 KV heads and keys as values, the head tied and its logits soft-capped
SHAPES["gemma4_text"] = {**BASE, "intermediate_size": 768, "num_experts": 32, "top_k_experts": 4,
                         "enable_moe_block": True, "hidden_size_per_layer_input": 0, "sliding_window": 128,
                         "per_layer_config": {i: {"head_dim": 128, "num_key_value_heads": 2} for i in ("5", "7")},
                         "attention_k_eq_v": True,
                         "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention",
                                                                     "full_attention"],
                         "final_logit_softcapping": 30.0, "tie_word_embeddings": True}
# LFM2-MoE (layer by layer: conv and attention mixers): 32 experts top-4 of 512, layer 0 dense (2048), attention in
# layers 2 and 5 of 8 (the release's share), short convolutions of 3 taps in the rest, the head tied
SHAPES["lfm2_moe"] = {**BASE, "num_experts": 32, "num_dense_layers": 1, "tie_embedding": True,
                      "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv",
                                      "conv"]}
# DBRX: 32 experts top-4 of 512 under its nested config, q/k/v clamped at the released 8, RoPE base 5e5
SHAPES["dbrx"] = {**{k: v for k, v in BASE.items() if k not in ("moe_intermediate_size", "head_dim")},
                  "d_model": 1024, "n_heads": 16, "n_layers": 8, "max_seq_len": 1024,
                  "attn_config": {"kv_n_heads": 4, "clip_qkv": 8, "rope_theta": 500000.0},
                  "ffn_config": {"ffn_hidden_size": 512, "moe_num_experts": 32, "moe_top_k": 4,
                                 "moe_normalize_expert_weights": 1.0},
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
SHAPES["deepseek_v3-g8"] = {**SHAPES["deepseek_v3"], "n_group": 8, "topk_group": 4}
# A.X K1: V3/R1's layers and router (8 groups, the best 4 kept) with the MoE block's output norm
SHAPES["axk1"] = {**SHAPES["deepseek_v3-g8"]}
# A.X K2 (Light): V3.2's shape at this size, no router groups, gated norms of rank 16 (llama.cpp: no converter)
SHAPES["axk2"] = {**{k: v for k, v in SHAPES["deepseek_v32"].items() if k not in ("n_group", "topk_group")},
                  "gated_norm_rank": 16}
# Reflection's Beam: AFMoE's layers with the gate's bias, NoPE full layers' query scale and depth-scaled adds; 32
# experts top-4 of 512 in 4 router groups (2 kept), no shared expert, layer 0 dense, every sixth layer and the last
# full, the others sliding over 128 (llama.cpp: no converter)
SHAPES["beam"] = {**BASE, "num_experts": 32, "n_group": 4, "topk_group": 2, "sliding_window": 128, "layer_types": None,
                  "mlp_layer_types": ["dense"] + ["sparse"] * 7}
# MiniMax-M3's text model: layer 0 dense and full, the others routed (32 experts top-4 of 512 beside a shared one of
# 512) with the sparse attention, partial RoPE over 32 of 64 channels, the clamped SwiGLU; the release's indexer
# (4 heads = the KV heads, blocks of 128, 16 kept: a 256-position context never selects, so the one-call step runs)
SHAPES["minimax_m3_vl_text"] = {**{k: v for k, v in BASE.items() if k != "moe_intermediate_size"},
                                "intermediate_size": 512, "dense_intermediate_size": 2048,
                                "shared_intermediate_size": 512, "num_local_experts": 32, "rotary_dim": 32,
                                "swiglu_limit": 7.0,  # (the release's: llama.cpp's swigluoai is gpt-oss's, fixed)
                                "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                    "partial_rotary_factor": 0.5},
                                "index_n_heads": 4, "index_head_dim": 64, "index_block_size": 128,
                                "index_topk_blocks": 16, "index_local_blocks": 1,
                                "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 7,
                                "mlp_layer_types": ["dense"] + ["sparse"] * 7}
# the same with 2 kept blocks of 16: past 32 positions each sparse layer's indexer selects and its attention runs in
# torch over the selected keys (the step layer by layer)
SHAPES["minimax_m3_vl_text-sparse"] = {**SHAPES["minimax_m3_vl_text"], "index_block_size": 16, "index_topk_blocks": 2}
MODES = ("one-call", "per-layer", "torch-mlp")
PROMPT = [1, 17, 42, 99, 7, 150, 23, 64]


def _set_mode(llm, mode: str, states: dict) -> None:
    """Switch the loaded model to `mode`'s path; `states` keeps each mode's decode-thread chooser and native run
    timings across rounds (the caller's dict, one per model)."""
    torch_mlp = mode == "torch-mlp"
    native_mlp.applies = (lambda t, x: False) if torch_mlp else _APPLIES
    native.bias_ok = (lambda m: m.bias is None) if torch_mlp else _BIAS_OK
    ernie4_5_moe.Router.native_routing = (lambda self: None) if torch_mlp else _ERNIE_RULE
    gpt_oss.SoftmaxTopKRouter.native_routing = (lambda self: None) if torch_mlp else _GPT_OSS_RULE
    deepseek_v2.Router.native_routing = (lambda self: None) if torch_mlp else _DS2_RULE
    deepseek_v3.Router.native_routing = (lambda self: None) if torch_mlp else _DS3_RULE
    mla.MLAttention.fused = (lambda self, *a: None) if torch_mlp else _MLA_BLOCK
    llama4_text.Llama4Attention.fused = (lambda self, *a: None) if torch_mlp else _L4_ATTN
    llama4_text.Llama4MoE.fused = (lambda self, *a: None) if torch_mlp else _L4_MOE
    for m in llm.model.modules():  # the cached kernel constants follow the mode
        if isinstance(m, Attention | mla.MLAttention):
            m._fused_layer = None
        if isinstance(m, SwitchGLU) and m.act is not silu_glu:  # gpt-oss's experts: kernels or torch
            m.__dict__.setdefault("_kernel_act", m.native_act)
            m.native_act = None if torch_mlp else m.__dict__["_kernel_act"]
            m._tables = None
    llm.store.source.forget_tables()
    llm.plan.rebuild(native=mode == "one-call")
    # Each mode keeps its own decode thread count and native run length: one mode's step timings steered the next
    # one (one-call rounds on one thread after per-layer ones: 381.6 instead of ~670 tok/s). They persist across
    # rounds: the first round of a mode times both thread counts, the later ones run the choice, as a serving
    # engine does (a fresh chooser every round made each round pay that exploration: 345.5 vs ~430 tok/s).
    runner = llm._runner
    states[states.get("current", "one-call")] = (runner.decode_threads, runner._step_s)
    runner.decode_threads, runner._step_s = states.get(mode) or (DecodeThreads(runner.decode_threads.candidates[-1]),
                                                                 {})
    states["current"] = mode


_APPLIES, _BIAS_OK, _ERNIE_RULE = native_mlp.applies, native.bias_ok, ernie4_5_moe.Router.native_routing
_GPT_OSS_RULE = gpt_oss.SoftmaxTopKRouter.native_routing
_DS2_RULE, _DS3_RULE = deepseek_v2.Router.native_routing, deepseek_v3.Router.native_routing
_MLA_BLOCK = mla.MLAttention.fused
_L4_ATTN, _L4_MOE = llama4_text.Llama4Attention.fused, llama4_text.Llama4MoE.fused


def _decode(llm, tokens: int) -> float:
    """Tokens per second after the first token (prefill excluded)."""
    t1 = None
    n = 0
    for _ in llm.generate_ids(PROMPT, max_tokens=tokens + 1, ignore_eos=True):
        n += 1
        if t1 is None:
            t1 = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t1)


def _prefill(llm, n: int) -> float:
    """Prefill tok/s of an n-token prompt: its time to the first token minus a 1-token prompt's (start-up
    cancels out), as benchmarks/bench_vs_llamacpp.py."""
    def first(ids: list[int]) -> float:
        t0 = time.perf_counter()
        next(iter(llm.generate_ids(ids, max_tokens=1, ignore_eos=True)))
        return time.perf_counter() - t0

    prompt = [3 + (7 * i) % 300 for i in range(n)]
    return (n - 1) / (first(prompt) - first(prompt[:1]))


def _llamacpp(src: Path, scheme: str, threads: int, tokens: int, prompt: int, cache: Path) -> tuple[str, str]:
    """llama.cpp's decode and prefill tok/s of `src` as GGUF (llama-bench tg`tokens` and pp`prompt`, 3
    repeats), or why there are none."""
    import llamacpp

    qtype = {"int8": "q8_0", "int4": "q4_0"}[scheme]
    try:
        gguf = llamacpp.to_gguf(src, src.with_name(f"{src.name}.{qtype}.gguf"), qtype, cache)
        r = subprocess.run(llamacpp.bench_cmd(llamacpp.build(cache), gguf, threads, prompt, tokens, 3),
                           capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()
        why = f"n/a: {last[-1][:60] if last else f'{Path(str(e.cmd[0])).name} exit {e.returncode}'}"
        return why, why
    got = llamacpp.parse_bench(r.stdout)
    return f"{got['decode_tok_s']:.1f}", f"{got['prefill_tok_s']:.1f}"


def _as_released(fam: str, src: Path) -> None:
    """The architecture name the released checkpoint carries where llama.cpp's converter keys on it (transformers
    saves its own class name)."""
    released = {"phimoe": "PhiMoEForCausalLM"}
    if fam in released:
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "architectures": [released[fam]]}, indent=2))


def _source(root: Path, fam: str) -> Path:
    """The family's random checkpoint folder, written if absent (seeded: the same weights each time)."""
    src = root / f"{fam}-hf"
    if not (src / "config.json").exists():
        make_tiny_checkpoint(fam.split("-")[0], src, **SHAPES[fam])  # (a variant: "family-name")
        _as_released(fam, src)
    return src


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--scheme", default="int8", choices=["int8", "int4"])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/colibri-one-call")
    p.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the same checkpoint (GGUF)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="also prefill tok/s of an N-token prompt (the default path; llama.cpp's ppN)")
    p.add_argument("--llamacpp-cache", default="/tmp/colibri-bench/llamacpp", help="its build and sdist")
    p.add_argument("--keep-sources", action="store_true",
                   help="keep each family's safetensors folder and GGUF files (~2 GB a family; the .coli is kept)")
    a = p.parse_args()
    root = Path(a.workdir)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {a.scheme}, {a.tokens} tokens, {a.rounds} rounds")
    print(f"{'family':12s} " + " ".join(f"{m + ' tok/s':>16s}" for m in MODES) + "  ratios to one-call"
          + ("   llama.cpp tok/s  one-call / llama.cpp" if a.llamacpp else ""))
    for fam in a.families:
        coli = root / f"{fam}.{a.scheme}.coli"
        if not coli.exists():
            convert(_source(root, fam), coli, a.scheme, progress=False)
        with colibri.load(coli, threads=a.threads, ctx_size=256) as llm:
            llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
            _decode(llm, 16)  # warm-up: the thread-count timing, the kernels' first builds
            states: dict = {}
            got: dict[str, list[float]] = {m: [] for m in MODES}
            pre: list[float] = []
            for _ in range(a.rounds):
                for m in MODES:
                    _set_mode(llm, m, states)
                    got[m].append(_decode(llm, a.tokens))
                    if a.prefill and m == "one-call":
                        pre.append(_prefill(llm, a.prefill))
            _set_mode(llm, "one-call", states)
        med = {m: statistics.median(v) for m, v in got.items()}
        ratios = " ".join(f"{med[m] / med['one-call']:.2f}" for m in MODES[1:])
        peer = ""
        if a.llamacpp:
            ll, ll_pre = _llamacpp(_source(root, fam), a.scheme, a.threads, a.tokens, a.prefill or 8,
                                   Path(a.llamacpp_cache))
            peer = f"   {ll:>15s}  " + (f"{med['one-call'] / float(ll):.2f}x" if ll[0].isdigit() else "")
        print(f"{fam:12s} " + " ".join(f"{med[m]:16.1f}" for m in MODES) + f"  {ratios:18s}{peer}", flush=True)
        if pre:
            line = f"  prefill of {a.prefill} tokens: {statistics.median(pre):.1f} tok/s"
            if a.llamacpp:
                line += f", llama.cpp pp{a.prefill} {ll_pre}" + \
                    (f": {statistics.median(pre) / float(ll_pre):.2f}x" if ll_pre[0].isdigit() else "")
            print(line, flush=True)
        if not a.keep_sources:  # (all families' folders and GGUFs took 74 GB of disk in one run)
            shutil.rmtree(root / f"{fam}-hf", ignore_errors=True)
            for gguf in root.glob(f"{fam}-hf.*.gguf"):
                gguf.unlink()
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
