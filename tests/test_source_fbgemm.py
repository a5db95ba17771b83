"""fbgemm_fp8 checkpoints (Llama-4-Maverick-17B-128E-Instruct-FP8's format): float8 weights with one f32 scale
per output channel, on Linear weights ([out, 1] scales) and on Llama 4's fused experts ([E, 1, 2I] for
gate_up_proj, [E, H, 1] for down_proj: fbgemm's quantizer scales the rows of the transposed weight). The
converted model is the one converted from the float weights they stand for, and gives transformers' logits."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import converts_to_its_floats, quantized_pair
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.convert.safetensors_reader import SafetensorsFolder
from colibri.convert.source_quant import dequantizing
from colibri.errors import ColibriError

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
QC = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}


def _rows(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 of w with one scale per slice along `dim` (the reduced one) -> (q, scale with dim kept as 1)."""
    s = (w.abs().amax(dim, keepdim=True) / 448.0).clamp_min(1e-8)
    return (w / s).to(torch.float8_e4m3fn), s


def _fbgemm_folder(src, dst):
    """An fbgemm_fp8 copy of a fused Llama 4 folder: the experts, the shared expert / dense MLPs and the
    attention projections float8, the rest as it was; and the float folder it stands for."""
    packed, deq = {}, {}
    for k, w in load_file(src / "model.safetensors").items():
        w = w.float()
        if k.endswith("experts.gate_up_proj"):  # [E, H, 2I], x @ W: a scale per output column, [E, 1, 2I]
            q, s = _rows(w, 1)
            packed |= {k: q, k + "_scale": s}
        elif k.endswith("experts.down_proj"):  # [E, I, H]: scales stored as [E, H, 1]
            q, s = _rows(w, 1)
            packed |= {k: q, k + "_scale": s.transpose(1, 2).contiguous()}
        elif k.endswith("_proj.weight") and (".feed_forward." in k or ".self_attn." in k):  # [out, in]
            q, s = _rows(w, 1)
            packed |= {k: q, k.removesuffix(".weight") + ".weight_scale": s}
        else:
            packed[k] = deq[k] = w
            continue
        deq[k] = q.float() * s
    return quantized_pair(src, dst, "fp8", packed, deq, QC)


def test_fbgemm_fp8_checkpoint_converts_to_the_weights_it_stands_for(ckpt, tmp_path):
    fp8, deq = _fbgemm_folder(ckpt.hf("llama4_text", fused=True), tmp_path)
    got = converts_to_its_floats(fp8, deq, tmp_path, IDS)
    with colibri.load(convert(fp8, tmp_path / "fp8.int8.coli", "int8", progress=False)) as llm:
        assert llm.logits(IDS).shape == got.shape


def test_the_reader_hides_the_scales_and_checks_them(ckpt, tmp_path):
    fp8, _ = _fbgemm_folder(ckpt.hf("llama4_text", fused=True), tmp_path)
    st = SafetensorsFolder(fp8)
    r = dequantizing(st, {"quantization_config": QC})
    names = set(r.names())
    assert not any(n.endswith("_scale") for n in names)
    down = next(n for n in names if n.endswith("experts.down_proj"))
    assert r.dtype(down) == "F32" and tuple(r.read(down, 1).shape) == st.shape(down)[1:]
    bad = tmp_path / "bad"
    tensors = load_file(fp8 / "model.safetensors")
    tensors[down + "_scale"] = tensors[down + "_scale"][:, :5].contiguous()  # a scale that fits no output channel
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ColibriError, match="does not fit"):
        dequantizing(SafetensorsFolder(bad), {"quantization_config": QC}).read(down, 0)
