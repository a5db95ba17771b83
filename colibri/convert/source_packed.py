"""GPTQ and AWQ checkpoints (zero-point ints packed in int32 words) read back in float.

Both store a linear `X` as `X.qweight` (int32 words of 32 / bits values), `X.qzeros` (the same packing,
one zero point per group and output), `X.scales` (f16 [groups, out]), GPTQ also `X.g_idx` (each input's
group: act-order checkpoints permute them), and the weight is (q - zero) * scale. They differ in layout:
- GPTQ (AutoGPTQ / GPTQModel, quant_method "gptq"): qweight [in / pack, out], input i at bits (i % pack) *
  bits of word row i // pack; qzeros [groups, out / pack], output o at (o % pack) * bits of word o // pack;
  `checkpoint_format` "gptq" (v1, the default) stores each zero minus one (a symmetric 4-bit checkpoint's
  words read 0x77777777: zero 8), "gptq_v2" stores it as is. 2, 4 and 8 bits (3 crosses words: refused).
- AWQ (AutoAWQ's `gemm` version, quant_method "awq"): qweight [in, out / 8] and qzeros [groups, out / 8],
  the 8 outputs of a word at nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7; 4 bits.
The converter then quantizes the float weights to `--quant` as any others: at int4 that is a second rounding
(the format's group minimum is an f16, which a zero point times an f16 scale mostly is not, so the groups'
grids cannot be kept as compressed-tensors' symmetric ones are); int8 or bf16 keep them closer.
"""

from __future__ import annotations

import torch

from ..errors import ColibriError

_AWQ_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)  # output j of a word sits at nibble _AWQ_SLOT[j] (AutoAWQ's pack order)


def unpack_words(words: torch.Tensor, bits: int, dim: int, slots: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words [.., n, ..] -> int64 values [.., n * 32 / bits, ..] along `dim` (0 or 1 of a 2-D tensor):
    value j of a word at bits slots[j] * bits.. (slots default 0, 1, 2, ...), unsigned."""
    pack = 32 // bits
    order = torch.arange(pack) if slots is None else torch.tensor(slots)
    shifts = order * bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:  # [n, cols] -> [n, pack, cols]
        vals = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return vals.reshape(-1, w.shape[1])
    vals = (w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [rows, n, pack]
    return vals.reshape(w.shape[0], -1)


class PackedInts:
    """A safetensors folder whose GPTQ / AWQ linears read back as `X.weight` f32 [out, in]; their companions
    are hidden, every other tensor passes through."""

    HIDDEN = ("qzeros", "scales", "g_idx")

    def __init__(self, st, qc: dict):
        self.st = st
        self.method = qc.get("quant_method")
        self.bits = int(qc.get("bits") or qc.get("w_bit") or 4)
        self.group = int(qc.get("group_size") or qc.get("q_group_size") or 128)
        self.v1 = self.method == "gptq" and (qc.get("checkpoint_format") or "gptq") == "gptq"
        if self.method == "gptq" and self.bits not in (2, 4, 8):
            raise ColibriError(f"quantization_config.bits {self.bits} of GPTQ is not supported (2, 4 or 8); "
                               "convert from the bf16 checkpoint")
        if self.method == "gptq" and (qc.get("checkpoint_format") or "gptq") not in ("gptq", "gptq_v2"):
            raise ColibriError(f"quantization_config.checkpoint_format {qc['checkpoint_format']!r} of GPTQ is not "
                               "supported (gptq, gptq_v2); convert from the bf16 checkpoint")
        if self.method == "awq" and (self.bits != 4 or (qc.get("version") or "gemm").lower() != "gemm"):
            raise ColibriError(f"AWQ {self.bits}-bit version {qc.get('version')!r} is not supported (4-bit gemm); "
                               "convert from the bf16 checkpoint")
        have = set(st.names())
        self.packed = {n.removesuffix("qweight") + "weight": n for n in have if n.endswith(".qweight")}
        self.have = have

    def __getattr__(self, attr):  # folder: as stored
        return getattr(self.st, attr)

    def names(self) -> list[str]:
        out = []
        for n in self.st.names():
            base, _, leaf = n.rpartition(".")
            if leaf == "qweight":
                out.append(base + ".weight")
            elif not (leaf in self.HIDDEN and base + ".qweight" in self.have):
                out.append(n)
        return out

    def dtype(self, name: str) -> str:
        return "F32" if name in self.packed else self.st.dtype(name)

    def nbytes(self, name: str) -> int:
        return self.st.nbytes(self.packed.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return self.st.shape(name)
        rows, cols = self.st.shape(self.packed[name])[-2:]
        pack = 32 // self.bits
        return (cols, rows * pack) if self.method == "gptq" else (cols * pack, rows)  # (out, in)

    def _part(self, name: str, leaf: str, index: int | None) -> torch.Tensor:
        comp = name.removesuffix("weight") + leaf
        if comp not in self.have:
            raise ColibriError(f"{name} is {self.method.upper()}-packed but the checkpoint has no {comp}")
        return self.st.read(comp, index)

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        if name not in self.packed:
            return self.st.read(name, index)
        q = self.st.read(self.packed[name], index)
        if q.dim() == 3:  # a fused [E, ...] tensor read whole
            return torch.stack([self._dequant(name, *parts) for parts in zip(
                q, self._part(name, "qzeros", index), self._part(name, "scales", index), *self._g_idx(name, index))])
        return self._dequant(name, q, self._part(name, "qzeros", index), self._part(name, "scales", index),
                             *self._g_idx(name, index))

    def _g_idx(self, name: str, index: int | None) -> list[torch.Tensor]:
        comp = name.removesuffix("weight") + "g_idx"
        return [self.st.read(comp, index)] if self.method == "gptq" and comp in self.have else []

    def _dequant(self, name: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                 g_idx: torch.Tensor | None = None) -> torch.Tensor:
        if q.dtype != torch.int32 or z.dtype != torch.int32 or q.dim() != 2 or z.dim() != 2:
            raise ColibriError(f"{self.packed[name]}: qweight / qzeros must be 2-D int32, got {q.dtype} "
                               f"{tuple(q.shape)} / {z.dtype} {tuple(z.shape)}")
        if self.method == "gptq":
            w = unpack_words(q, self.bits, 0)  # [in, out]
            zeros = unpack_words(z, self.bits, 1) + int(self.v1)  # [groups, out]
        else:
            w = unpack_words(q, 4, 1, _AWQ_SLOT)
            zeros = unpack_words(z, 4, 1, _AWQ_SLOT)
        n_in, out = w.shape
        groups = g_idx.long() if g_idx is not None else torch.arange(n_in) // (self.group if self.group > 0 else n_in)
        if groups.shape != (n_in,) or s.shape[-1] != out or zeros.shape[1] < out or s.shape[0] > zeros.shape[0] \
                or int(groups.min()) < 0 or int(groups.max()) >= s.shape[0]:
            raise ColibriError(f"{name}: qweight {tuple(q.shape)}, qzeros {tuple(z.shape)}, scales {tuple(s.shape)} "
                               f"do not fit {self.bits}-bit groups of {self.group} (quantization_config)")
        return ((w - zeros[groups, :out]).float() * s.float()[groups]).t().contiguous()  # [out, in]
