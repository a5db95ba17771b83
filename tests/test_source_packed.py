"""GPTQ and AWQ checkpoints convert to the weights they stand for: the test packs its own ints the way
AutoGPTQ (sequential along the input, zeros stored minus one) and AutoAWQ (`gemm`: along the output, nibble
order 0, 2, 4, 6, 1, 3, 5, 7) write them, and the converted model gives transformers' logits on the
dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import converts_to_its_floats, quantized_pair
from safetensors.torch import load_file, save_file

from colibri.convert.safetensors_reader import SafetensorsFolder
from colibri.convert.source_packed import unpack_words
from colibri.convert.source_quant import dequantizing
from colibri.errors import ColibriError

IDS = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble p of a word holds output AWQ_ORDER[p]


def _words(v: torch.Tensor) -> torch.Tensor:
    """int64 values < 2^32 -> the int32 words with those bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _pack_rows(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: [in, out] -> [in / pack, out], input r * pack + j at bits j * bits of word row r."""
    pack = 32 // bits
    v = ints.to(torch.int64).reshape(-1, pack, ints.shape[1])
    return _words(sum(v[:, j] << (bits * j) for j in range(pack)))


def _pack_cols(ints: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[rows, out] -> [rows, out / pack]: nibble p of word c holds output c * pack + order[p]."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    v = ints.to(torch.int64).reshape(ints.shape[0], -1, pack)
    return _words(sum(v[:, :, order[p]] << (bits * p) for p in range(pack)))


def test_unpack_reads_both_layouts():
    g = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        ints = torch.randint(0, 1 << bits, (64, 24), generator=g)
        assert torch.equal(unpack_words(_pack_rows(ints, bits), bits, 0), ints)
        assert torch.equal(unpack_words(_pack_cols(ints.t().contiguous(), bits), bits, 1), ints.t())
    ints = torch.randint(0, 16, (5, 32), generator=g)
    assert torch.equal(unpack_words(_pack_cols(ints, 4, AWQ_ORDER), 4, 1, (0, 4, 1, 5, 2, 6, 3, 7)), ints)
    # a symmetric 4-bit GPTQ checkpoint's zero words read 0x77777777: 7 stored, zero 8 (v1 stores zero - 1)
    assert unpack_words(torch.tensor([[0x77777777]], dtype=torch.int32), 4, 1).tolist() == [[7] * 8]


def _quant(w: torch.Tensor, groups: torch.Tensor, n_groups: int):
    """Zero-point int4 of w [out, in] per (output, group of inputs): (q [in, out], zeros [G, out], scales f16
    [G, out], the weights they stand for [out, in])."""
    out, n_in = w.shape
    q = torch.zeros(n_in, out, dtype=torch.int64)
    zeros = torch.zeros(n_groups, out, dtype=torch.int64)
    scales = torch.zeros(n_groups, out, dtype=torch.float16)
    for gi in range(n_groups):
        cols = (groups == gi).nonzero().flatten()
        wg = w[:, cols]  # [out, n]
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).clamp_min(1e-6).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).long()
        q[cols] = (torch.round(wg / s.float()[:, None]) + z[:, None]).clamp(0, 15).long().t()
        zeros[gi], scales[gi] = z, s
    deq = ((q - zeros[groups]).float() * scales.float()[groups]).t().contiguous()
    return q, zeros, scales, deq


def _packed_folder(src, dst, method: str):
    """A GPTQ (4-bit, groups of 32, v1 zeros, act-order g_idx on the attention projections) or AWQ (gemm, groups
    of 32) copy of `src` with every linear of the decoder layers packed, and a folder of the float weights they
    stand for."""
    g = torch.Generator().manual_seed(1)
    packed, deq = {}, {}
    for k, w in load_file(src / "model.safetensors").items():
        base = k.removesuffix("weight")
        if w.dim() == 2 and (".mlp.experts." in k or ".self_attn." in k):
            n_in = w.shape[1]
            groups = torch.arange(n_in) // 32
            if method == "gptq" and ".self_attn." in k:
                groups = groups[torch.randperm(n_in, generator=g)]  # act-order: inputs' groups permuted
            q, zeros, scales, deq[k] = _quant(w.float(), groups, n_in // 32)
            if method == "gptq":
                packed |= {base + "qweight": _pack_rows(q, 4), base + "qzeros": _pack_cols(zeros - 1, 4),
                           base + "scales": scales, base + "g_idx": groups.to(torch.int32)}
            else:
                packed |= {base + "qweight": _pack_cols(q, 4, AWQ_ORDER),
                           base + "qzeros": _pack_cols(zeros, 4, AWQ_ORDER), base + "scales": scales}
        else:
            packed[k] = deq[k] = w
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
          "checkpoint_format": "gptq"} if method == "gptq" else \
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    return quantized_pair(src, dst, method, packed, deq, qc)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_checkpoint_converts_to_the_weights_it_stands_for(ckpt, tmp_path, method):
    pq, deq = _packed_folder(ckpt.hf("qwen3_moe"), tmp_path, method)
    st = SafetensorsFolder(pq)
    r = dequantizing(st, json.loads((pq / "config.json").read_text()))
    names = set(r.names())
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for n in names)
    want = load_file(deq / "model.safetensors")
    for n in names:
        assert r.shape(n) == tuple(want[n].shape) and torch.equal(r.read(n).float(), want[n].float()), n
    converts_to_its_floats(pq, deq, tmp_path, IDS)


def test_a_group_index_out_of_range_is_an_error_not_a_wrapped_index(ckpt, tmp_path):
    pq, _ = _packed_folder(ckpt.hf("qwen3_moe"), tmp_path, "gptq")
    tensors = load_file(pq / "model.safetensors")
    name = next(k for k in tensors if k.endswith("self_attn.q_proj.g_idx"))
    for bad in (-1, 99):
        tensors[name] = tensors[name].clone()
        tensors[name][3] = bad
        save_file(tensors, str(pq / "model.safetensors"))
        r = dequantizing(SafetensorsFolder(pq), json.loads((pq / "config.json").read_text()))
        with pytest.raises(ColibriError, match="do not fit 4-bit groups of 32"):
            r.read(name.removesuffix("g_idx") + "weight")


def test_unsupported_packings_are_refused_by_name(ckpt):
    st = SafetensorsFolder(ckpt.hf("qwen3_moe"))
    for qc, match in (({"quant_method": "gptq", "bits": 3}, "bits 3 of GPTQ"),
                      ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "'marlin' of GPTQ"),
                      ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'")):
        with pytest.raises(ColibriError, match=match):
            dequantizing(st, {"quantization_config": qc})
