"""Pre-quantized checkpoints in llm-compressor's compressed-tensors format (Kimi-K2-Thinking's int4 experts,
GLM-4.5-FP8, RedHatAI's w4a16 models) convert to the weights they stand for: packed ints unpacked as the
compressed-tensors library packs them, scales per group / channel / block, and the converted model gives
transformers' logits on the dequantized weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import converts_to_its_floats, quantized_pair
from safetensors.torch import load_file

import colibri
from colibri.convert.converter import convert
from colibri.convert.safetensors_reader import SafetensorsFolder
from colibri.convert.source_quant import dequantizing, unpack_int32
from colibri.errors import ColibriError

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("cols", [32, 50, 96])
def test_unpack_reads_what_compressed_tensors_packs(bits, cols):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(bits * 100 + cols)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (7, cols), generator=g).to(torch.int8)
    packed = helpers.pack_to_int32(q, bits)
    assert torch.equal(unpack_int32(packed, bits, cols), q)


def _int_group(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric ints per group of `group` inputs: (q int8 [out, in], scale bf16 [out, in / group])."""
    top = (1 << (bits - 1)) - 1
    g = w.reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1) / top).clamp_min(1e-8).to(torch.bfloat16)  # [out, in / group]
    q = torch.round(g / scale.float()[..., None]).clamp(-top - 1, top).reshape(w.shape).to(torch.int8)
    return q, scale


def _compressed_folder(src, dst):
    """A compressed-tensors copy of `src`: routed experts int4 in groups of 32 (pack-quantized, as Kimi-K2-
    Thinking), attention projections float8 per output channel (float-quantized), the rest as it was; and a
    folder with the float weights they stand for."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    packed, deq = {}, {}
    for k, w in load_file(src / "model.safetensors").items():
        base = k.removesuffix(".weight")
        if ".mlp.experts." in k and w.dim() == 2:
            q, s = _int_group(w.float(), 4, 32)
            packed |= {base + ".weight_packed": helpers.pack_to_int32(q, 4), base + ".weight_scale": s,
                       base + ".weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
            deq[k] = q.float() * s.float().repeat_interleave(32, 1)
        elif ".self_attn." in k and w.dim() == 2:  # (every 2-D weight there is a Linear's)
            s = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-8)  # [out, 1]
            q = (w.float() / s).to(torch.float8_e4m3fn)
            packed |= {k: q, base + ".weight_scale": s}
            deq[k] = q.float() * s
            if k.endswith("o_proj.weight"):  # an FP8 KV cache's scales, which colibri does not use
                attn = k.removesuffix("o_proj.weight")
                packed |= {attn + "k_scale": torch.tensor(0.5), attn + "v_scale": torch.tensor(0.25)}
        else:
            packed[k] = deq[k] = w
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
          "config_groups": {
              "group_0": {"targets": ["re:.*mlp\\.experts.*"], "format": "pack-quantized",
                          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 32}},
              "group_1": {"targets": ["re:.*self_attn.*"], "format": "float-quantized",
                          "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}},
          "ignore": ["lm_head"]}
    return quantized_pair(src, dst, "ct", packed, deq, qc)


def test_compressed_tensors_checkpoint_converts_to_the_weights_it_stands_for(ckpt, tmp_path):
    ct, deq = _compressed_folder(ckpt.hf("deepseek_v3"), tmp_path)
    got = converts_to_its_floats(ct, deq, tmp_path, IDS)
    # int4 in groups of 32 stays int4 (re-quantized from the dequantized weights)
    c = convert(ct, tmp_path / "ct4.coli", "int4", 32, progress=False)
    with colibri.load(c) as llm:
        assert llm.logits(IDS).shape == got.shape


def test_the_reader_hides_scales_and_names_unpacked_weights(ckpt, tmp_path):
    ct, _ = _compressed_folder(ckpt.hf("deepseek_v3"), tmp_path)
    cfg = json.loads((ct / "config.json").read_text())
    st = SafetensorsFolder(ct)
    r = dequantizing(st, cfg)
    names = set(r.names())
    packed = next(n for n in st.names() if n.endswith(".weight_packed"))
    w = packed.removesuffix("_packed")
    assert w in names and not any(n.endswith(("_packed", "_scale", "_shape")) for n in names)
    assert r.shape(w) == tuple(r.read(w).shape) and r.dtype(w) == "F32"


def test_unsupported_quantizations_are_refused_by_name(ckpt, tmp_path):
    ct, _ = _compressed_folder(ckpt.hf("deepseek_v3"), tmp_path)
    st = SafetensorsFolder(ct)
    with pytest.raises(ColibriError, match="'bitsandbytes' is not supported"):
        dequantizing(st, {"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ColibriError, match="'marlin-24'"):
        dequantizing(st, {"quantization_config": {"quant_method": "compressed-tensors", "format": "marlin-24"}})
    asym = {"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized",
                                                                         "weights": {"symmetric": False}}}}
    with pytest.raises(ColibriError, match="asymmetric"):
        dequantizing(st, {"quantization_config": asym})
    src = tmp_path / "src"
    shutil.copytree(ckpt.hf("deepseek_v3"), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(ColibriError, match="quant_method 'hqq' is not supported"):
        convert(src, tmp_path / "m.coli", "f32", progress=False)


def test_transformers_reads_the_test_checkpoint_as_the_same_weights(ckpt, tmp_path):
    """The oracle of the format itself: transformers + the compressed-tensors library decompress the folder
    the tests write to the weights colibri reads from it (its experts land in bf16 parameters: rounded)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    ct, deq = _compressed_folder(ckpt.hf("deepseek_v3"), tmp_path)
    sd = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32).state_dict()
    want = load_file(deq / "model.safetensors")
    L = json.loads((ct / "config.json").read_text())["num_hidden_layers"] - 1
    p = f"model.layers.{L}.mlp.experts"
    n = sd[f"{p}.down_proj"].shape[0]
    gate_up = torch.stack([torch.cat([want[f"{p}.{e}.gate_proj.weight"], want[f"{p}.{e}.up_proj.weight"]])
                           for e in range(n)])
    down = torch.stack([want[f"{p}.{e}.down_proj.weight"] for e in range(n)])
    assert torch.equal(sd[f"{p}.gate_up_proj"].float(), gate_up.to(sd[f"{p}.gate_up_proj"].dtype).float())
    assert torch.equal(sd[f"{p}.down_proj"].float(), down.to(sd[f"{p}.down_proj"].dtype).float())
    attn = f"model.layers.{L}.self_attn.o_proj.weight"  # (kept in float8, its scale beside it, for FP8 matmuls)
    assert torch.equal(sd[attn].float() * sd[attn + "_scale"].float(), want[attn].float())


def test_int4_groups_already_on_a_grid_are_stored_exactly():
    """A symmetric int4 checkpoint's q * s (Kimi-K2-Thinking's experts) re-quantized to colibri's int4 in
    the same groups: every group, even one using few of the 16 levels, dequantizes to the same weights;
    weights on no grid are quantized as without the flag."""
    from colibri.quant import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    k = torch.randint(-8, 8, (64, 256), generator=g).float()
    k[:, :32] = torch.randint(-3, 3, (64, 32), generator=g).float()  # a narrow group
    k[:, 32:64] = 2 * torch.randint(-4, 4, (64, 32), generator=g).float()  # even levels only
    s = (torch.rand(64, 8, generator=g) * 0.02 + 1e-3).to(torch.bfloat16).float()
    w = k * s.repeat_interleave(32, 1)
    plain = dequantize(quantize(w, "int4", 32), "int4", (64, 256), 32)
    assert not torch.equal(plain, w)  # (min/max scaling rounds the narrow groups again)
    assert torch.equal(dequantize(quantize(w, "int4", 32, grid=True), "int4", (64, 256), 32), w)
    r = torch.randn(64, 256, generator=g)
    a, b = quantize(r, "int4", 32), quantize(r, "int4", 32, grid=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_packed_int4_checkpoint_converts_to_int4_without_a_second_rounding(ckpt, tmp_path):
    from colibri.format.container import Container
    from colibri.quant import dequantize

    ct, deq = _compressed_folder(ckpt.hf("deepseek_v3"), tmp_path)
    path = convert(ct, tmp_path / "ct4.coli", "int4", 32, progress=False)
    want = load_file(deq / "model.safetensors")
    c = Container(path)
    try:
        names = [n for n in c.record_names() if ".mlp.experts." in n]
        assert names
        for rec in names:
            members = c.record(rec)["tensors"]
            down = {s.removeprefix("down.weight"): c.tensor(f) for s, f in members.items()
                    if s.startswith("down.weight")}
            info = c.info(members["down.weight"])["quant"]
            assert (info["scheme"], info["group_size"]) == ("int4", 32)
            got = dequantize(down, "int4", tuple(info["shape"]), 32)
            assert torch.equal(got, want[f"{rec}.down_proj.weight"]), rec
    finally:
        c.close()
