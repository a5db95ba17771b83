"""Checks the tiny-checkpoint helper the oracle tests stand on.

If these fail, every oracle test comparing colibri with transformers is
meaningless, so they pin down: each family builds and reloads bit-for-bit
(up to f32 summation order), both on-disk layouts hold the same model, the
tokenizer loads in transformers and round-trips text, and greedy decoding has
clear top1-top2 gaps so the oracle compares decisions, not rounding noise.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import hf_tiny as H
import pytest
import torch
import transformers
from safetensors import safe_open

# f32 logits of the same weights can differ by ~1e-5 between two loads: the
# BLAS kernels' summation order depends on the buffers' alignment (seen for
# olmoe/qwen3_moe: 1.5e-5 with logits of std 12).
LOAD_ATOL = 1e-4


def _names(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        out = {}
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
        return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tiny")
    return {mt: H.make_tiny_checkpoint(mt, root / mt) for mt in H.FAMILIES}


@pytest.fixture(scope="module")
def built_fused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tiny_fused")
    return {mt: H.make_tiny_checkpoint(mt, root / mt, fused=True) for mt in H.FAMILIES}


def test_tokenizer_loads_and_round_trips(tmp_path: Path) -> None:
    H.make_tokenizer_files(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == H.VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (H.PAD_ID, H.BOS_ID, H.EOS_ID)
    for text in [H.PROMPT, "Hello, world!\n  two  spaces\ttab", "café ☕ naïve — 日本", H.TRAIN_TEXT[:500]]:
        ids = tok(text).input_ids
        assert ids[0] == H.BOS_ID and ids.count(H.BOS_ID) == 1
        assert ids == H.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == text
    # BPE actually learned merges: English text is much shorter than its bytes.
    assert len(H.encode(H.TRAIN_TEXT)) < 0.6 * len(H.TRAIN_TEXT.encode())


def test_tokenizer_is_deterministic(tmp_path: Path) -> None:
    first = H._tokenizer_json()
    H._tokenizer_json.cache_clear()
    H._tokenizer.cache_clear()
    assert H._tokenizer_json() == first
    H.make_tokenizer_files(tmp_path)
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8") == first


def test_chat_template(tmp_path: Path) -> None:
    H.make_tokenizer_files(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(H.BOS_ID) == 1 and ids[0] == H.BOS_ID
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids


@pytest.mark.parametrize("model_type", H.FAMILIES)
def test_builds_and_reloads(model_type: str, built: dict[str, Path]) -> None:
    folder = built[model_type]
    cfg = json.loads((folder / "config.json").read_text())
    if model_type in H.MULTIMODAL:  # saved as the multimodal model, the text model's config inside
        assert cfg["model_type"] == H.MULTIMODAL[model_type][0] and "vision_config" in cfg
        cfg = cfg["text_config"]
    assert cfg["model_type"] == model_type
    assert cfg["vocab_size"] == H.VOCAB_SIZE
    assert {cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]} <= set(range(H.VOCAB_SIZE))
    model = H.load_hf(folder)  # AutoModelForCausalLM.from_pretrained underneath
    assert model.config._attn_implementation == "eager"
    assert next(model.parameters()).dtype == torch.float32
    ids = H.encode(H.PROMPT)
    ref = H.hf_logits(H.build_tiny_model(model_type), ids)
    torch.testing.assert_close(H.hf_logits(model, ids), ref, atol=LOAD_ATOL, rtol=0)


@pytest.mark.parametrize("model_type", H.FAMILIES)
def test_on_disk_layouts(model_type: str, built: dict[str, Path], built_fused: dict[str, Path]) -> None:
    legacy, fused = _names(built[model_type]), _names(built_fused[model_type])
    assert all(dt == "F32" for dt, _ in legacy.values())
    granite = ("granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid")
    ff = ".feed_forward." if model_type in ("llama4_text", "lfm2_moe", "jamba") \
        else ".block_sparse_moe." if model_type in granite \
        else "." if model_type == "gemma4_text" else ".mixer." if model_type == "nemotron_h" \
        else ".mlp.text_moe." if model_type == "ernie4_5_vl_moe_text" \
        else ".mlp."  # (Gemma 4's experts sit beside its dense MLP; ERNIE-4.5-VL's text experts beside vision ones)
    fused_name = "up_proj" if model_type == "nemotron_h" else "gate_up_proj"  # (Nemotron-H's experts have no gate)
    fused_experts = {k for k in fused if f"{ff}experts.{fused_name}" in k}
    if model_type == "dbrx":  # one layout: experts fused as [E·I, H] (w1, v1, w2), q/k/v as Wqkv
        assert legacy == fused and any(k.endswith(".ffn.experts.mlp.w1") for k in legacy)
        assert any(k.endswith(".attn.Wqkv.weight") for k in legacy)
    else:
        assert fused_experts, "fused layout must hold [E, ...] expert tensors"
    if model_type in ("gpt_oss", "llama4_text", "mistral4", "dbrx", "granitemoe_swa", "gemma4_text",
                      "minimax_m3_vl_text"):
        # gpt-oss and Llama 4 ship fused even through save_pretrained (Mistral 4, Granite's SWA MoE, Gemma 4,
        # MiniMax-M3's text model: transformers has no other form for them; M3's release names: test_minimax_m3.py).
        assert legacy == fused
    elif model_type in granite:  # fused both ways, under the released names (input_linear / output_linear)
        assert any(".block_sparse_moe.input_linear.weight" in k for k in legacy) and legacy.keys() != fused.keys()
    elif model_type == "aria_text":  # fused both ways, x @ W both ways: the release's names (fc1 / fc2) on save
        assert any(k.endswith(".mlp.experts.fc1.weight") for k in legacy) and legacy.keys() != fused.keys()
    elif model_type in H.HUB_EXPERTS_XW:  # fused both ways, the hub's layout transposed (x @ W)
        assert legacy.keys() == fused.keys() and any(legacy[k] != fused[k] for k in fused_experts)
    else:
        assert not any("gate_up_proj" in k or k.endswith("experts.up_proj") for k in legacy)
        per_expert = (
            ".block_sparse_moe.experts.0.w1.weight" if model_type in ("mixtral", "minimax_m2", "phimoe", "minimax",
                                                                      "kimi_linear")
            else ".feed_forward.experts.0.w1.weight" if model_type == "lfm2_moe"
            else ".feed_forward.experts.0.gate_proj.weight" if model_type == "jamba"
            else ".mixer.experts.0.up_proj.weight" if model_type == "nemotron_h"
            else ".mlp.experts.0.gate_proj.weight"
        )
        assert any(per_expert in k for k in legacy)
    # Same weights: both layouts load to the same model.
    ids = H.encode(H.PROMPT)
    a = H.hf_logits(H.load_hf(built[model_type]), ids)
    b = H.hf_logits(H.load_hf(built_fused[model_type]), ids)
    torch.testing.assert_close(a, b, atol=LOAD_ATOL, rtol=0)


@pytest.mark.parametrize("model_type", H.FAMILIES)
def test_routers_and_norms_are_nontrivial(model_type: str) -> None:
    # Default init leaves these constant; an engine that skipped loading them
    # would then still match, so the helper must have randomized them.
    state = H.build_tiny_model(model_type).state_dict()
    for name, t in state.items():
        if t.is_floating_point() and t.numel() > 1:
            assert t.std() > 0, f"{name} is constant"
    if model_type in ("glm4_moe", "deepseek_v3", "minimax_m2", "dots1", "ernie4_5_moe", "ernie4_5_vl_moe_text"):
        bias = [t for k, t in state.items() if k.endswith("e_score_correction_bias")]
        assert bias and all(b.abs().min() > 0 for b in bias)


@pytest.mark.parametrize("model_type", H.FAMILIES)
def test_greedy_logits_are_peaked(model_type: str) -> None:
    model = H.build_tiny_model(model_type)
    toks, logits = H.hf_greedy_with_logits(model, H.encode(H.PROMPT), 40)
    assert len(toks) == 40 and logits.shape == (40, H.VOCAB_SIZE)
    margins = H.top2_margins(logits)
    # Measured minima (see hf_tiny): 0.0030 (deepseek_v3) .. 0.19; f32
    # engine-vs-transformers differences are ~1e-5.
    assert margins.min() > 2e-3, margins.min()
    assert (margins < 1e-2).sum() <= 1
    assert margins.median() > 1.0


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_greedy_cache_matches_full_forward(model_type: str) -> None:
    # The cached loop must see what one full forward sees; gpt_oss's window of
    # 8 is crossed well within 40 tokens.
    model = H.build_tiny_model(model_type)
    prompt = H.encode(H.PROMPT)
    toks, logits = H.hf_greedy_with_logits(model, prompt, 40)
    full = H.hf_logits(model, prompt + toks[:-1])[len(prompt) - 1 :]
    torch.testing.assert_close(logits, full, atol=1e-3, rtol=0)
    assert full.argmax(-1).tolist() == toks


def test_greedy_ignores_eos() -> None:
    model = H.build_tiny_model("mixtral")
    # Make eos win every step: the helper must keep going anyway.
    model.lm_head.register_forward_hook(
        lambda _m, _i, out: out.index_add(-1, torch.tensor([H.EOS_ID]), torch.full((*out.shape[:-1], 1), 1e3))
    )
    assert H.hf_greedy(model, H.encode(H.PROMPT), 12) == [H.EOS_ID] * 12  # hf_greedy is the thin wrapper


def test_bf16_on_disk_and_overrides(tmp_path: Path) -> None:
    folder = H.make_tiny_checkpoint("deepseek_v3", tmp_path / "ds", dtype=torch.bfloat16, q_lora_rank=None)
    names = _names(folder)
    assert all(dt == "BF16" for dt, _ in names.values())
    assert any(k.endswith("self_attn.q_proj.weight") for k in names)
    assert not any("q_a_proj" in k for k in names)
    model = H.load_hf(folder)
    assert next(model.parameters()).dtype == torch.float32
    assert torch.isfinite(H.hf_logits(model, H.encode(H.PROMPT))).all()


def test_weights_are_deterministic(tmp_path: Path) -> None:
    a = H.make_tiny_checkpoint("qwen2_moe", tmp_path / "a")
    b = H.make_tiny_checkpoint("qwen2_moe", tmp_path / "b")
    c = H.make_tiny_checkpoint("qwen2_moe", tmp_path / "c", seed=1)

    def digest(p: Path) -> str:
        return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()

    assert digest(a) == digest(b) != digest(c)
