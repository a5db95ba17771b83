"""Config fields of the tiny models tests/hf_tiny.py builds, one entry per family (`tiny_config_kwargs`), and the
families the family-wide tests run over (`FAMILIES`). Sizes are chosen so that every family-specific code path is
exercised at least once."""

from __future__ import annotations

from typing import Any

FAMILIES: tuple[str, ...] = (
    "mixtral",
    "olmoe",
    "qwen3_moe",
    "qwen2_moe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "minimax_m2",
    "dots1",
    "ernie4_5_moe",
    "llama4_text",
    "hunyuan_v1_moe",
    "glm4_moe_lite",
    "exaone_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "mistral4",
    "deepseek_v32",
    "glm_moe_dsa",
    "mimo_v2_flash",
    "qwen3_vl_moe_text",
    "glm4v_moe_text",
    "phimoe",
    "solar_open",
    "granitemoe",
    "dbrx",
    "granitemoeshared",
    "granitemoe_swa",
    "afmoe",
    "flex_olmo",
    "hy_v3",
    "flint",
    "kolibri1",
    "axk1",
    "mellum",
    "cohere2_moe",
    "laguna",
    "gemma4_text",
    "lfm2_moe",
    "granitemoehybrid",
    "jamba",
    "nemotron_h",
    "longcat_flash",
    "minimax",
    "kimi_linear",
    "bailing_hybrid",
    "axk2",
    "beam",
    "minimax_m3_vl_text",
    "ernie4_5_vl_moe_text",
    "qwen3_omni_moe_text",
    "aria_text",
)

# The dense families (no MoE layer: the small draft models of speculative decoding), kept out of FAMILIES, whose
# tests (tests/test_hf_tiny.py) look for experts; tests/test_dense_families.py covers them.
DENSE: tuple[str, ...] = ("llama", "qwen3", "qwen2")

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # (tests/hf_tiny.py's special tokens come first, so their ids are fixed)
# 256 byte symbols + 6 specials + 122 merges. The model vocab equals the
# tokenizer vocab exactly, so every id the model can emit decodes.
VOCAB_SIZE = 384

# Std of every weight matrix. Larger than transformers' 0.02 on purpose: with
# 0.02 the residual stream is mostly the token embedding and the experts add a
# few percent, so an engine with a broken expert path could still match.
WEIGHT_STD = 0.12


def tiny_config_kwargs(model_type: str) -> dict[str, Any]:
    """Config fields for a tiny model of `model_type` (before user overrides).

    Sizes are chosen so that every family-specific code path is exercised at
    least once: a dense first layer where the family has one, shared experts,
    group-limited routing, MLA with and without a q LoRA, partial rotary,
    qk-norm, sliding-window layers, biases, sinks.
    """
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "max_position_embeddings": 256,
        "initializer_range": WEIGHT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "num_experts_per_tok": 2,
    }
    moe_i = 32  # routed (and shared) expert width, smaller than the dense MLP
    # GLM-4.5's MoE layers (dense layer 0, a shared expert, group-limited sigmoid routing), which dots1 shares
    glm_moe = {"n_routed_experts": 8, "moe_intermediate_size": moe_i, "n_shared_experts": 1,
               "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
               "norm_topk_prob": True, "head_dim": 16}
    # DeepSeek-V3's layers (MLA with a q LoRA, dense layer 0, a shared expert), which GLM-4.7-Flash, Mistral 4,
    # DeepSeek-V3.2 and GLM-5 build on
    mla = {"n_routed_experts": 8, "moe_intermediate_size": moe_i, "n_shared_experts": 1, "first_k_dense_replace": 1,
           "norm_topk_prob": True, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4}
    dsa = {"index_topk": 8, "index_head_dim": 16, "index_n_heads": 4}  # (the sparse attention keeps 8 positions)
    granite = {"num_local_experts": 4, "embedding_multiplier": 1.5, "attention_multiplier": 0.2,
               "residual_multiplier": 0.8, "logits_scaling": 1.5,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    family: dict[str, dict[str, Any]] = {
        "mixtral": {"num_local_experts": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "olmoe": {"num_experts": 8, "norm_topk_prob": False, "clip_qkv": None},
        "qwen3_moe": {
            "num_experts": 8,
            "moe_intermediate_size": moe_i,
            "head_dim": 16,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        "qwen2_moe": {
            "num_experts": 4,
            "moe_intermediate_size": moe_i,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            # layer 1 is a plain dense MLP (intermediate_size): tests the
            # sparse/dense layer selection.
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "qkv_bias": True,
        },
        "glm4_moe": {**glm_moe, "use_qk_norm": True, "partial_rotary_factor": 0.5, "attention_bias": True},
        "deepseek_v2": {
            "n_routed_experts": 8,
            "moe_intermediate_size": moe_i,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            # V2-Lite style: no q LoRA, q_proj directly.
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "num_key_value_heads": 4,
        },
        "deepseek_v3": {**mla, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "rope_interleave": True},
        # GLM-4.7-Flash: DeepSeek-V3's layers; layer 0 sparse, layer 1 dense (mlp_layer_types, not first_k);
        # v wider than q/k's nope part, as released (256 vs 192)
        "glm4_moe_lite": {**{k: v for k, v in mla.items() if k != "first_k_dense_replace"},
                          "mlp_layer_types": ["sparse", "dense", "sparse"], "n_group": 1, "topk_group": 1,
                          "routed_scaling_factor": 1.8, "v_head_dim": 32,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        # K-EXAONE: sliding layers 0 and 2 (RoPE, 8 positions: a 32+ token run crosses it), full layers 1 and 3
        # without RoPE; layer 0 dense; GLM's grouped router
        "exaone_moe": {
            "num_hidden_layers": 4,
            "num_experts": 8,
            "moe_intermediate_size": moe_i,
            "num_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
        # Qwen3-Next: linear attention (Gated DeltaNet, 2 key heads of 4 value heads) in layers 0 and 2, gated full
        # attention in layer 1 (a quarter of its head rotated), layer 1 dense
        "qwen3_next": {
            "num_experts": 8,
            "moe_intermediate_size": moe_i,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": True,
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "mlp_only_layers": [1],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        },
        # Qwen3.5 MoE: Qwen3-Next's layers with four linear-layer input projections, every layer MoE
        "qwen3_5_moe_text": {
            "num_experts": 8,
            "moe_intermediate_size": moe_i,
            "shared_expert_intermediate_size": 48,
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        },
        # Qwen3-VL MoE's text model (built and saved as the multimodal model: tests/hf_tiny.py MULTIMODAL): Qwen3-MoE's
        # layers, interleaved multimodal RoPE, a router that always renormalises (the config says otherwise here)
        "qwen3_vl_moe_text": {
            "num_experts": 8,
            "moe_intermediate_size": 48,  # (2 x 48 != hidden: transformers' loader tells the layouts apart by shape)
            "head_dim": 16,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True},
        },
        # Aria's text model: Llama attention (its biases), an MoE in every layer with shared experts, x @ W experts
        "aria_text": {"moe_num_experts": 8, "moe_topk": 2, "moe_num_shared_experts": 2, "intermediate_size": 32,
                      "head_dim": 16, "attention_bias": True,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}},
        # The dense families (DENSE; their tied heads: tests/test_dense_families.py): Llama with its q/k/v/o biases and
        # llama3 RoPE scaling
        "llama": {"head_dim": 16, "attention_bias": True,
                  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}},
        # Qwen3's per-head q/k norm, heads wider than hidden / heads (as Qwen3-0.6B's)
        "qwen3": {"head_dim": 32,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        # Qwen2's q/k/v biases; layer 2 slides over 8 positions (use_sliding_window, max_window_layers 2)
        "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        # Qwen3-Omni's thinker text model (built and saved as the thinker): Qwen3-MoE's layers, the router
        # unrenormalised here (it follows norm_topk_prob), a dense layer, the interleaved M-RoPE
        "qwen3_omni_moe_text": {
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True},
        },
        # GLM-4.5V's text model (built and saved as the multimodal model): GLM-4.5's layers with attention biases and
        # the multimodal RoPE over the rotated half (2 + 1 + 1 of its 4 frequencies)
        "glm4v_moe_text": {**glm_moe, "attention_bias": True,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                               "mrope_section": [2, 1, 1]}},
        # Phi-3.5-MoE: Mixtral's layers with LayerNorms, biases (attention, lm_head), the sparsemixer router (a
        # wide jitter, so that second candidates share the softmax) and longrope past 16 positions (equal scales)
        "phimoe": {"num_local_experts": 4, "attention_bias": True, "lm_head_bias": True, "router_jitter_noise": 0.3,
                   "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                       "original_max_position_embeddings": 16,
                                       "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                       "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.5, 11.5, 15.0],
                                       "short_mscale": 1.2, "long_mscale": 1.2}},
        # Granite 3.x MoE: Mixtral's layers, the top-k-then-softmax router, the four multipliers (the released tied
        # head makes these random models repeat their last token: tests/test_granitemoe.py checks one's logits)
        "granitemoe": granite,
        # Granite MoE with a shared expert; Granite's sliding-window MoE (granite-swash): that and sinks, layer 0 full
        # without RoPE, layers 1-2 sliding over 8 positions with RoPE bases of their own
        "granitemoeshared": {**granite, "shared_intermediate_size": 64},
        # Granite 4.0-H: Mamba-2, attention (no RoPE, as the releases) and Mamba-2 layers over the shared-expert MoE;
        # 4 heads of 32 channels in 2 groups of 16 states, prompts in SSD chunks of 8 (so they span several)
        "granitemoehybrid": {**granite, "shared_intermediate_size": 48, "position_embedding_type": "nope",
                             "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                             "mamba_n_heads": 4, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
                             "mamba_chunk_size": 8},
        # Jamba: Mamba + dense, Mamba + experts, attention (no RoPE) + dense, Mamba + experts; 4 experts top-2 of
        # intermediate_size's width (its experts' too), Mamba of 8 states over 128 channels (dt rank 4)
        "jamba": {"num_hidden_layers": 4, "num_experts": 4, "attn_layer_period": 4, "attn_layer_offset": 2,
                  "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4},
        # Nemotron-H: one sublayer a layer: Mamba-2, experts, attention (no RoPE), dense MLP, Mamba-2, experts; 8
        # ungated relu^2 experts top-2 in 2 groups (1 kept) with a selection bias beside a shared one; Mamba-2 of 4
        # heads of 32 in 2 groups of 16 states, prompts in SSD chunks of 8
        "nemotron_h": {"num_hidden_layers": 6, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 32,
                       "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                                             "moe"],
                       "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8, "n_routed_experts": 8,
                       "moe_intermediate_size": moe_i, "moe_shared_expert_intermediate_size": 48, "n_group": 2,
                       "topk_group": 1, "routed_scaling_factor": 1.5},
        # LongCat-Flash: 3 layers of two MLA sublayers (q LoRA) with dense MLPs and a shortcut MoE of 8 routed and 4
        # zero-computation experts, top-3 by score + selection bias, scaled (transformers counts 2 x 3 layers)
        "longcat_flash": {"num_hidden_layers": 6, "num_layers": 3, "ffn_hidden_size": 96,
                          "expert_ffn_hidden_size": moe_i, "n_routed_experts": 8, "zero_expert_num": 4, "moe_topk": 3,
                          "routed_scaling_factor": 1.5,
                          "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                          "head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4,
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # MiniMax-Text-01 / M1: lightning attention, full attention (RoPE over the whole head), lightning; 4 experts
        # top-2 of 32 (Mixtral's router); prompts in lightning blocks of 8; weighted residuals over the normed stream
        "minimax": {"num_local_experts": 4, "intermediate_size": moe_i, "head_dim": 16, "block_size": 8,
                    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                    "full_attn_alpha_factor": 1.5, "linear_attn_alpha_factor": 1.3, "linear_attn_beta_factor": 0.9,
                    "mlp_alpha_factor": 1.2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # Kimi-Linear: KDA, MLA without RoPE (q LoRA), KDA, KDA; layer 0 dense, then DeepSeek-V3's MoE (8 experts top-2
        # in 2 groups, 1 kept, a shared expert); KDA of 2 heads of 16 with a 4-tap convolution
        "kimi_linear": {**mla, "num_hidden_layers": 4, "num_local_experts": 8, "n_group": 2, "topk_group": 1,
                        "routed_scaling_factor": 1.5, "linear_head_dim": 16, "linear_num_heads": 2,
                        "linear_conv_kernel_dim": 4,
                        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
        # Ling 3.0 hybrid: KDA (full-rank gates, bounded decay), KDA, MLA (no q LoRA, a gate per head), KDA: groups
        # of 3; layer 0 dense, then DeepSeek-V3's MoE (8 experts top-2 in 2 groups, 1 kept, a shared expert); KDA of
        # the 4 heads x 16 (head_dim), a 4-tap convolution
        "bailing_hybrid": {**{k: v for k, v in mla.items() if k not in ("n_routed_experts", "q_lora_rank")},
                           "num_experts": 8, "num_hidden_layers": 4, "layer_group_size": 3, "n_group": 2,
                           "topk_group": 1, "routed_scaling_factor": 1.5, "head_dim": 16, "kda_lower_bound": -3.0,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        "granitemoe_swa": {**granite, "shared_intermediate_size": 64, "sliding_window": 8,
                           "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                           "layer_rope_theta": [0, 1e4, 5e4]},
        # Arcee's AFMoE: norms on both sides of each sublayer, gated attention, layer 1 full without RoPE between two
        # sliding over 8, layer 0 dense, a sigmoid router with a selection bias, muP's embedding scale
        "afmoe": {"num_experts": 8, "moe_intermediate_size": moe_i, "num_shared_experts": 1, "num_dense_layers": 1,
                  "route_scale": 1.5, "head_dim": 16, "sliding_window": 8, "mup_enabled": True,
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # FlexOlmo: OLMoE's layers with the norms after each sublayer only (and a router that does not renormalise)
        "flex_olmo": {"num_experts": 8, "norm_topk_prob": False,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        # Hy3: GLM's one-group sigmoid router scaled after renormalising, a shared expert, q/k norm; dense layer 1
        # (mlp_layer_types, not transformers' default layer 0), a head wider than hidden / heads
        "hy_v3": {"num_experts": 8, "moe_intermediate_size": moe_i, "num_shared_experts": 1, "head_dim": 32,
                  "router_scaling_factor": 1.7, "mlp_layer_types": ["sparse", "dense", "sparse"],
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        # Flint: sinks in every layer, sliding layers 0 and 2 with RoPE over 8 positions, full layer 1 without RoPE
        # (and dense); a sigmoid router beside an ungated shared expert
        "flint": {"num_experts": 8, "moe_intermediate_size": moe_i, "shared_expert_intermediate_size": 64,
                  "head_dim": 16, "norm_topk_prob": True, "sliding_window": 8, "mlp_only_layers": [1],
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # Kolibri-1: sliding layers 0 and 2 with RoPE over 8 positions, full layer 1 without RoPE; each sublayer's
        # output norm; the router choosing by logit + bias, weighting by sigmoid, beside a shared expert
        "kolibri1": {"num_experts": 8, "moe_intermediate_size": moe_i, "shared_expert_intermediate_size": 64,
                     "head_dim": 16, "norm_topk_prob": True, "sliding_window": 8,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # A.X K1: DeepSeek-V3's layers (2 router groups here) with the MoE output norm; layer 0 dense
        "axk1": {**mla, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "rope_interleave": True},
        # Mellum 2: Qwen3-MoE's layers; layer 1 sliding over 8 positions with its own RoPE base, layer 0 dense
        "mellum": {"num_local_experts": 8, "moe_intermediate_size": moe_i, "head_dim": 16, "norm_topk_prob": True,
                   "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
                   "mlp_layer_types": ["dense", "sparse", "sparse"],
                   "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e2}}},
        # Command A MoE: parallel blocks, LayerNorms, interleaved RoPE; layer 0 a dense prefix layer (full, rotated),
        # layer 1 sliding (rotated), layer 2 full without RoPE; a shared expert averaged in; the head scaled (untied
        # here: tests/test_cohere2_moe.py ties it)
        "cohere2_moe": {"num_experts": 8, "intermediate_size": 32, "prefix_dense_intermediate_size": 96, "head_dim": 16,
                        "num_shared_experts": 1, "sliding_window": 8, "first_k_dense_replace": 1,
                        "sliding_window_pattern": 2, "logit_scale": 0.5,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # Laguna: layer 1 full with half its head rotated and 2 heads, layers 0 and 2 sliding over 8 with 4 heads;
        # each head's output gated by softplus; layer 0 dense; GLM's router with a selection bias, scaled
        "laguna": {"num_experts": 8, "moe_intermediate_size": moe_i, "shared_expert_intermediate_size": 64,
                   "head_dim": 16, "sliding_window": 8, "num_attention_heads_per_layer": [4, 2, 4],
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                   "moe_routed_scaling_factor": 1.5,
                   "rope_parameters": {
                       "full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}},
        # Gemma 4 MoE: a sliding layer over 8 positions (head 16, 2 KV heads, RoPE over the whole head), two full ones
        # (head 32, 1 KV head, the values k_proj's output, "proportional" RoPE on a quarter of the frequencies), a
        # dense GELU MLP beside the experts in every layer, soft-capped logits (untied: test_gemma4_text.py ties it)
        "gemma4_text": {
            "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": moe_i, "enable_moe_block": True,
            "head_dim": 16, "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 1},
                                                 "2": {"head_dim": 32, "num_key_value_heads": 1}},
            "attention_k_eq_v": True, "hidden_size_per_layer_input": 0, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "full_attention"], "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}},
        # LFM2-MoE: a conv layer, an attention layer and a conv layer (kernel 3), layer 0's feed-forward dense, the
        # others experts chosen with a selection bias, renormalised and scaled; the head untied (as the release's is
        # tied: test_lfm2_moe.py ties it)
        "lfm2_moe": {"num_experts": 8, "moe_intermediate_size": moe_i, "num_dense_layers": 1,
                     "layer_types": ["conv", "full_attention", "conv"], "routed_scaling_factor": 1.5,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        # DBRX: Mixtral's layers under a nested config with its own names, LayerNorms without a bias, q/k/v fused
        # and clamped (at 2.0 a few percent of them are), experts fused as [E·I, H]
        "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 3, "max_seq_len": 256,
                 "attn_config": {"kv_n_heads": 2, "clip_qkv": 2.0, "rope_theta": 1e4},
                 "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2,
                                "moe_normalize_expert_weights": 1.0},
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # Solar Open: GLM-4.5's MoE layers in every layer (two router groups, one kept), Llama's attention with q/k/v
        # biases, RoPE over the whole head
        "solar_open": {"n_routed_experts": 8, "moe_intermediate_size": moe_i, "n_shared_experts": 1, "n_group": 2,
                       "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": True, "head_dim": 16,
                       "attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        # Mistral Small 4: DeepSeek-V3's layers, a softmax router (one group, renormalised: the kernels' rule), YaRN,
        # queries scaled past position 16 (the oracle's runs cross it)
        "mistral4": {**mla, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                     "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
                                         "partial_rotary_factor": 8 / 24}},
        # DeepSeek-V3.2: V3's layers plus the sparse attention's indexer, keeping 8 positions (the oracle's runs
        # of 36+ tokens select)
        "deepseek_v32": {**mla, **dsa, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
        # A.X K2 (Light): V3.2's layers with gated norms (rank 8) and a gated query, no router groups
        "axk2": {**mla, **dsa, "routed_scaling_factor": 2.5, "gated_norm_rank": 8},
        # Reflection's Beam: AFMoE's sandwich norms and gated attention (with a bias a head), sliding layers 0 and 2
        # over 8 with RoPE, full layer 1 without (its queries scaled by position), depth-scaled residual adds; layer 0
        # dense, then DeepSeek-V3's grouped sigmoid router (8 experts in 2 groups, 1 kept), no shared expert; the
        # logits soft-capped at the release's 30 (the default)
        "beam": {"num_experts": 8, "moe_intermediate_size": moe_i, "head_dim": 16, "sliding_window": 8,
                 "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                 "mlp_layer_types": ["dense", "sparse", "sparse"],
                 "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                     "full_attention": None}},
        # MiniMax-M3: zero-centred norms, q/k norms per head, partial RoPE (8 of 16 channels: the factor given too,
        # which transformers' port reads), a dense layer 0 and two sparse-attention layers whose indexer keeps 3
        # blocks of 4 keys (so prompts past 12 positions select; with 2 kept, near-tied blocks flip between bf16
        # paths: a selection is discrete), gpt-oss's clamped SwiGLU (clamping at 0.5), the biased sigmoid router
        # beside a shared expert
        "minimax_m3_vl_text": {"num_local_experts": 8, "intermediate_size": moe_i, "dense_intermediate_size": 96,
                               "shared_intermediate_size": 64, "head_dim": 16, "rotary_dim": 8,
                               "routed_scaling_factor": 1.5, "swiglu_limit": 0.5, "index_n_heads": 2,
                               "index_head_dim": 16, "index_block_size": 4, "index_topk_blocks": 3,
                               "index_local_blocks": 1,
                               "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
                               "mlp_layer_types": ["dense", "sparse", "sparse"],
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}},
        # GLM-5: V3.2's layers, the indexer's RoPE interleaved, layer 1 sharing layer 0's selection (8 positions)
        "glm_moe_dsa": {**mla, **dsa, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "v_head_dim": 32,
                        "indexer_types": ["full", "shared", "full"]},
        # MiMo-V2-Flash: layer 0 full attention, layers 1-2 sliding over 8 positions with sinks and twice the KV
        # heads; q/k heads of 24, values of 16 scaled by 0.707; a third of each head rotated, per layer type
        "mimo_v2_flash": {
            "n_routed_experts": 8,
            "moe_intermediate_size": moe_i,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": True,
            "head_dim": 24,
            "v_head_dim": 16,
            "sliding_window": 8,
            "attention_value_scale": 0.707,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}},
        },
        # dots1: GLM's MoE layers; its last layer slides over 8 positions (a 32+ token run crosses it).
        "dots1": {**glm_moe, "sliding_window": 8, "max_window_layers": 2},
        "ernie4_5_moe": {
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": moe_i,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,  # layer 0 dense
            "head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
        # ERNIE-4.5-VL's text model: ERNIE-4.5's layers with text experts (and vision experts beside, unused by
        # text) of two widths; head 16 = 8 frequency pairs in M-RoPE sections [3, 3, 2]
        "ernie4_5_vl_moe_text": {
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": [moe_i, 16],
            "moe_num_shared_experts": 1,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]},
        },
        "minimax_m2": {
            "num_local_experts": 8,
            "head_dim": 32,  # (hidden / heads is 16: the released model's head is wider than that too)
            "rotary_dim": 16,  # RoPE on half of each head, the rest passes (the released config's field)
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6},
        },
        "hunyuan_v1_moe": {
            "num_experts": 8,
            "moe_topk": 2,
            "intermediate_size": 32,  # the experts' and the shared MLP's width
            "head_dim": 16,
            # Hunyuan-A13B's RoPE: "dynamic" with a fixed alpha (the base stretched by alpha^(d / (d - 2)))
            "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
        },
        "llama4_text": {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "head_dim": 16,
            "num_hidden_layers": 4,  # RoPE on layers 0-2, none on 3 (no_rope_layer_interval 4)
            "interleave_moe_layer_step": 2,  # layers 1 and 3 MoE, 0 and 2 dense
            "intermediate_size": 32,  # the experts' (and the shared expert's) width
            "intermediate_size_mlp": 96,  # the dense layers'
            "attention_chunk_size": 16,  # 36-token runs cross two chunk boundaries on the RoPE layers
            "floor_scale": 4,  # the temperature tuning of the layer without RoPE moves within the test's context
            "attn_scale": 0.1,
            "attention_bias": True,  # (none in the released models: here so the converter's q/k row order covers them)
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64},
        },
        "gpt_oss": {
            "num_local_experts": 4,
            "head_dim": 16,
            "num_hidden_layers": 4,
            # Tiny window so a 32+ token run crosses it on the sliding layers.
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            # Real gpt-oss uses YaRN; keep it, with factors consistent with the
            # tiny context so transformers does not warn.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        },
    }
    if model_type not in family:
        raise ValueError(f"unknown model_type {model_type!r}; known: {', '.join(FAMILIES + DENSE)}")
    if model_type in DENSE:  # (no router field in a dense config)
        del common["num_experts_per_tok"]
    return {**common, **family[model_type]}
