"""Write a random OLMoE-shaped Hugging Face checkpoint without building the model in transformers.

    .venv/bin/python benchmarks/synth_ckpt.py --out /tmp/colibri-bench/olmoe-7b-hf [--layers 16 ...]

A 7B-parameter model does not fit a transformers instantiation on a 24 GB box (f32 init
alone is 28 GB), so tensors are drawn one at a time and streamed into safetensors shards
whose headers are computed up front from the shapes. Peak RSS is the largest tensor in f32.
Used by bench_capped.py; importable (`write_olmoe`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# OLMoE-1B-7B-0924's config.json, minus the fields transformers fills in by default.
OLMOE_7B = {"hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
            "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
            "vocab_size": 50304}
_SHARD_BYTES = 4 << 30  # like HF's default max_shard_size: few files, none huge


def olmoe_config(**kw) -> dict:
    from hf_tiny import BOS_ID, EOS_ID, PAD_ID

    c = {**OLMOE_7B, **kw}
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **c,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "clip_qkv": None, "norm_topk_prob": False, "attention_bias": False, "tie_word_embeddings": False,
            "hidden_act": "silu", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
            "dtype": "bfloat16"}


def tensor_plan(cfg: dict) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(HF name, shape, mean, std) of every tensor, in the order HF checkpoints list them.

    Scales keep a random model numerically alive over 16 layers: matrices get std
    1/sqrt(fan_in) (unit-variance outputs), the embedding unit std so the token still
    matters next to the block outputs, the router a wider std so routing is peaked rather
    than uniform-flat, lm_head 4x so greedy top-1 gaps are far above bf16 rounding.
    """
    H, F, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]  # F: expert width
    E, V = cfg["num_experts"], cfg["vocab_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...], float, float]] = [("model.embed_tokens.weight", (V, H), 0.0, 1.0)]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), 1.0, 0.1),
                (p + "post_attention_layernorm.weight", (H,), 1.0, 0.1),
                (p + "self_attn.q_proj.weight", (H, H), 0.0, H ** -0.5),
                (p + "self_attn.k_proj.weight", (kv, H), 0.0, H ** -0.5),
                (p + "self_attn.v_proj.weight", (kv, H), 0.0, H ** -0.5),
                (p + "self_attn.o_proj.weight", (H, H), 0.0, H ** -0.5),
                (p + "self_attn.q_norm.weight", (H,), 1.0, 0.1),
                (p + "self_attn.k_norm.weight", (kv,), 1.0, 0.1),
                (p + "mlp.gate.weight", (E, H), 0.0, 2 * H ** -0.5)]
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (F, H), 0.0, H ** -0.5),
                    (q + "up_proj.weight", (F, H), 0.0, H ** -0.5),
                    (q + "down_proj.weight", (H, F), 0.0, F ** -0.5)]
    out += [("model.norm.weight", (H,), 1.0, 0.1), ("lm_head.weight", (V, H), 0.0, 4 * H ** -0.5)]
    return out


def _draw(name: str, shape: tuple[int, ...], mean: float, std: float, seed: int) -> torch.Tensor:
    # A generator per tensor, seeded by its name: any tensor can be regenerated alone.
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g) * std + mean).to(torch.bfloat16)


def _shards(plan, dtype_size: int) -> list[list]:
    shards, cur, size = [], [], 0
    for item in plan:
        n = math.prod(item[1]) * dtype_size
        if cur and size + n > _SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += n
    return shards + [cur] if cur else shards


def write_olmoe(out: str | Path, seed: int = 0, progress: bool = True, **cfg_overrides) -> Path:
    """Write config.json, tokenizer files and bf16 safetensors shards (+ index) to `out`."""
    from hf_tiny import make_tokenizer_files

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = olmoe_config(**cfg_overrides)
    plan = tensor_plan(cfg)
    shards = _shards(plan, 2)
    total = sum(math.prod(s) * 2 for _, s, _, _ in plan)
    weight_map, done = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, _, _ in shard:
            n = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors wants the data 8-aligned
        tmp = out / (fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for name, shape, mean, std in shard:
                t = _draw(name, shape, mean, std, seed)
                f.write(t.view(torch.int16).numpy().tobytes())
                done += t.nbytes
                if progress and (done >> 28) != ((done - t.nbytes) >> 28):  # every 256 MiB
                    print(f"\r  writing {out.name}: {done / 2**30:5.1f} / {total / 2**30:.1f} GiB", end="",
                          file=sys.stderr, flush=True)
        os.replace(tmp, out / fname)
    if progress:
        print(file=sys.stderr)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    make_tokenizer_files(out)
    # config.json last: its presence marks a complete checkpoint (bench_capped skips regeneration).
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=OLMOE_7B["num_hidden_layers"])
    ap.add_argument("--experts", type=int, default=OLMOE_7B["num_experts"])
    ap.add_argument("--hidden", type=int, default=OLMOE_7B["hidden_size"])
    ap.add_argument("--intermediate", type=int, default=OLMOE_7B["intermediate_size"])
    ap.add_argument("--vocab", type=int, default=OLMOE_7B["vocab_size"])
    a = ap.parse_args()
    write_olmoe(a.out, a.seed, num_hidden_layers=a.layers, num_experts=a.experts, hidden_size=a.hidden,
                intermediate_size=a.intermediate, vocab_size=a.vocab)


if __name__ == "__main__":
    main()
