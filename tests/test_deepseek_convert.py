"""Converting DeepSeek checkpoints: config refusals, MTP layers dropped on request, FP8 block dequantization."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import converts_dropping, edited_copy, hf_logits, load_hf, tiny_config_kwargs
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.convert.source_quant import dequantize_fp8
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models import deepseek_v2, deepseek_v3

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ----------------------------------------------------------------------------- check_config


def _cfg(model_type: str, **kw) -> dict:
    return {"model_type": model_type, **tiny_config_kwargs(model_type), **kw}


REFUSED = [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group"),
    ("deepseek_v2", {"hidden_act": "gelu"}, "hidden_act"),
]


@pytest.mark.parametrize("model_type,change,field", REFUSED, ids=[f"{m}-{f}" for m, _, f in REFUSED])
def test_check_config_refuses_naming_the_field(model_type, change, field):
    module = deepseek_v2 if model_type == "deepseek_v2" else deepseek_v3
    module.check_config(_cfg(model_type))  # the tiny config itself is fine
    with pytest.raises(ColibriError, match=field):
        module.check_config(_cfg(model_type, **change))


def test_convert_runs_check_config(ckpt, tmp_path):
    src = edited_copy(ckpt.hf("deepseek_v3"), tmp_path / "src", topk_method="greedy")
    with pytest.raises(ColibriError, match="topk_method 'greedy'"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)


# ----------------------------------------------------------------------------- MTP layers


def test_mtp_layer_is_dropped_and_recorded_with_no_mtp(ckpt, tmp_path):
    """--no-mtp (kept by default: tests/test_spec_mtp.py)."""
    src = edited_copy(ckpt.hf("deepseek_v3"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    assert cfg["num_nextn_predict_layers"] == 1

    def mtp(base: dict) -> dict:  # V3's MTP module: its own embed/norms/projection/head plus a decoder layer at n
        return {f"model.layers.{n}.{k}": torch.randn(4, 4)
                for k in ("embed_tokens.weight", "eh_proj.weight", "shared_head.head.weight")} | {
            f"model.layers.{n}.{k}": torch.ones(4) for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")
        } | {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in base.items()
             if k.startswith(f"model.layers.{n - 1}.")}

    out = converts_dropping(src, mtp, ckpt.coli("deepseek_v3", "f32"), tmp_path / "m.coli", IDS, keep_mtp=False)
    with Container(out) as c:
        assert not any(name.startswith(f"model.layers.{n}.") for name in c.names())


# ----------------------------------------------------------------------------- FP8


def test_dequantize_fp8_blocks_by_hand():
    # A [5, 7] weight in 2x3 blocks: scale_inv is [3, 3]; edge blocks are partial.
    q = (torch.arange(35, dtype=torch.float32).view(5, 7) / 4 - 4).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0], [3.0, 10.0, 0.125]])
    got = dequantize_fp8(q, s, (2, 3))
    for i in range(5):
        for j in range(7):
            assert got[i, j].item() == q[i, j].float().item() * s[i // 2, j // 3].item()
    with pytest.raises(ColibriError, match="weight_block_size"):
        dequantize_fp8(q, s[:2], (2, 3))


def _to_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize like DeepSeek's FP8 release: per-block scale = amax / 448."""
    out, n_in = w.shape
    so, si = -(-out // block), -(-n_in // block)
    scale = torch.empty(so, si)
    for a in range(so):
        for b in range(si):
            scale[a, b] = w[a * block : (a + 1) * block, b * block : (b + 1) * block].abs().amax() / FP8_MAX
    full = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :n_in]
    return (w / full).to(torch.float8_e4m3fn), scale


def _fp8_folder(src, dst, block: int = 16, drop_scale_of: str | None = None):
    """An FP8 copy of `src` (linear weights but embeddings, lm_head and routers) + the f32 it stands for."""
    fp8, deq = {}, {}
    for k, w in load_file(src / "model.safetensors").items():
        if w.dim() == 2 and not any(s in k for s in ("embed_tokens", "lm_head", "mlp.gate.")):
            q, s = _to_fp8(w, block)
            fp8[k], deq[k] = q, dequantize_fp8(q, s, (block, block))
            if k != drop_scale_of:
                fp8[k.removesuffix("weight") + "weight_scale_inv"] = s
        else:
            fp8[k] = deq[k] = w
    for folder, tensors, extra in ((dst / "fp8", fp8, True), (dst / "deq", deq, False)):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
        save_file(tensors, str(folder / "model.safetensors"))
        if extra:
            cfg = json.loads((folder / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic", "weight_block_size": [block, block]}
            (folder / "config.json").write_text(json.dumps(cfg))
    return dst / "fp8", dst / "deq"


def test_fp8_checkpoint_converts_to_its_dequantized_weights(ckpt, tmp_path):
    fp8, deq = _fp8_folder(ckpt.hf("deepseek_v3"), tmp_path)
    a = convert(fp8, tmp_path / "fp8.coli", "f32", progress=False)
    b = convert(deq, tmp_path / "deq.coli", "f32", progress=False)
    with Container(a) as ca, Container(b) as cb:
        assert ca.names() == cb.names()
        for name in cb.names():
            assert torch.equal(ca.tensor(name), cb.tensor(name)), name
        assert ca.meta["converter"]["dropped"] == []  # the scales were consumed, not dropped
    # and the model runs as transformers does on the weights the FP8 file stands for
    logits = colibri.load(a, ctx_size=64, threads=2).logits(IDS)
    assert (logits - hf_logits(load_hf(deq), IDS)).abs().max() < 1e-4


def test_fp8_weight_without_scale_is_refused(ckpt, tmp_path):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    fp8, _ = _fp8_folder(ckpt.hf("deepseek_v3"), tmp_path, drop_scale_of=name)
    with pytest.raises(ColibriError, match=f"{name}.*weight_scale_inv"):
        convert(fp8, tmp_path / "m.coli", "f32", progress=False)


def test_kimi_k25s_multimodal_checkpoint_converts_to_its_text_model(ckpt, tmp_path):
    """Kimi-K2.5 as released (`kimi_k25`): DeepSeek-V3's text model under `language_model.` with a vision tower
    and projector beside it, its config under `text_config` (as `kimi_k2`)."""
    src = tmp_path / "k25"
    shutil.copytree(ckpt.hf("deepseek_v3"), src)
    text = json.loads((src / "config.json").read_text())
    base = load_file(src / "model.safetensors")
    vision = {"vision_tower.encoder.blocks.0.wo.weight": torch.randn(4, 4),
              "mm_projector.proj.0.weight": torch.randn(4, 4)}
    (src / "model.safetensors").unlink()
    save_file({f"language_model.{k}": v for k, v in base.items()} | vision, str(src / "model.safetensors"))
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
           "text_config": {**text, "model_type": "kimi_k2"}, "vision_config": {"depth": 1}}
    (src / "config.json").write_text(json.dumps(cfg))
    out = convert(src, tmp_path / "k25.coli", "f32", progress=False)
    with Container(out) as c:
        assert c.model_type == "deepseek_v3" and sorted(c.meta["converter"]["dropped"]) == sorted(vision)
    ours = colibri.load(out, ctx_size=64, threads=2).logits(IDS)
    ref = colibri.load(ckpt.coli("deepseek_v3", "f32"), ctx_size=64, threads=2).logits(IDS)
    assert torch.equal(ours, ref)
