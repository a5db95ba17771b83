"""Time MLA's forms (one layer, DeepSeek-V2-Lite or V3 dims) and report KV bytes.

    .venv/bin/python benchmarks/bench_mla.py [--shape v2-lite|v3] [--threads 2] [--ctx 512 2048]
        [--prefill 128 512] [--quant int8|int4|bf16|f32]
    .venv/bin/python benchmarks/bench_mla.py --kernel [--shape v3] [--ctx 512 2048 4096]

Decode: one new token over a cache already holding ctx-1 tokens (the whole attention
module: projections, RoPE, cache write, attention, o_proj). Prefill: T tokens from an
empty cache. Columns: "native", the native block (kernels/mla.c: the absorbed form, with the input
and post-attention norms and the residual; int8/int4 weights at bf16 only), and torch's "absorbed" and
"expanded" forms. KV bytes per token per layer compare the latent cache with the K/V an ordinary
attention cache would hold. `--kernel`: the block's attention alone for one decode row, heads in groups
sharing each pass over the latent cache (`coli_mla_attn`) against the ordinary attention kernel with one
kv head (`coli_attn_rows`: each head its own pass, as the block first did), microseconds.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from colibri.kernels import native_attn, native_mla
from colibri.layers.batch import LayerKV
from colibri.layers.layers import Linear, RMSNorm
from colibri.layers.mla import MLAArgs, MLAttention
from colibri.quant import QLinear

SHAPES = {  # heads, q_lora_rank, kv_lora_rank, nope, rope, v, hidden
    "v2-lite": (16, None, 512, 128, 64, 128, 2048),
    "v3": (128, 1536, 512, 128, 64, 128, 7168),
}


def _best_ms(fn: Callable[[], object], iters: int, min_s: float) -> float:
    """Fastest of >= iters calls (and >= min_s seconds): robust to other load on a small box."""
    for _ in range(2):
        fn()
    best, n, t_end = float("inf"), 0, time.perf_counter() + min_s
    while n < iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best * 1e3


def _time_mode(attn: MLAttention, mode: str, x: torch.Tensor, cache, start: int, iters: int,
               min_s: float) -> float | None:
    """Best ms of one layer call in `mode` ("native": the fused block; None where it does not apply)."""
    kv = LayerKV([(0, x.shape[0], start, cache)], start)
    if mode == "native":
        attn.mode = "absorbed"
        norm = RMSNorm(attn.a.hidden)
        if attn.fused(x, kv, norm, norm) is None:
            return None
        return _best_ms(lambda: attn.fused(x, kv, norm, norm), iters, min_s)
    attn.mode = mode
    return _best_ms(lambda: attn(x, kv), iters, min_s)


def build(shape: str, scheme: str, dtype: torch.dtype) -> MLAttention:
    H, q_lora, R, Dn, Dr, Dv, hidden = SHAPES[shape]
    attn = MLAttention(MLAArgs(hidden, H, q_lora, R, Dn, Dr, Dv, 10000.0, max_pos=8192))
    gen = torch.Generator().manual_seed(0)
    for name, mod in list(attn.named_children()):
        if isinstance(mod, Linear):
            w = torch.randn(mod.out_features, mod.in_features, generator=gen) * mod.in_features**-0.5
            setattr(attn, name, QLinear.from_dense(w, scheme, compute_dtype=dtype))
    return attn


def kernel(args: argparse.Namespace) -> None:
    """--kernel: one decode row's attention over the latent cache, grouped heads vs one pass per head."""
    H, _, R, _, Dr, _, _ = SHAPES[args.shape]
    W, gen = R + Dr, torch.Generator().manual_seed(2)
    print(f"{args.shape}: {H} heads over a latent cache of {W} channels (values {R}), best-of us per call, "
          f"threads {args.threads}; load {os.getloadavg()[0]:.2f}")
    print(f"{'positions':>10} {'grouped':>10} {'per head':>10} {'ratio':>7}")
    for S in args.ctx:
        q = torch.randn(1, H, W, generator=gen).bfloat16()
        kv = torch.randn(S, W, generator=gen).bfloat16()
        grouped = _best_ms(lambda q=q, kv=kv, S=S: native_mla.mla_attn(q, [kv], [S], R, 0.1), args.iters,
                           args.min_s) * 1e3
        per_head = _best_ms(lambda q=q, kv=kv, S=S: native_attn.attn_rows(q, [kv[None]], [kv[None]], [S], 0.1),
                            args.iters, args.min_s) * 1e3
        print(f"{S:10d} {grouped:10.0f} {per_head:10.0f} {per_head / grouped:7.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def kv_bytes_per_token(shape: str, itemsize: int) -> tuple[int, int]:
    H, _, R, Dn, Dr, Dv, _ = SHAPES[shape]
    return (R + Dr) * itemsize, H * (Dn + Dr + Dv) * itemsize


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--quant", choices=["bf16", "f32", "int8", "int4"], default="int8", help="projection weights")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--min-s", type=float, default=0.5)
    ap.add_argument("--kernel", action="store_true", help="time the attention kernel alone (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernel:
        kernel(args)
        return
    dtype = torch.float32 if args.quant == "f32" else torch.bfloat16
    attn = build(args.shape, args.quant, dtype)
    hidden = attn.a.hidden
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, shape {args.shape}, "
          f"weights {args.quant}, compute {dtype}; best-of ms per layer call; load {os.getloadavg()[0]:.2f}")

    print(f"{'case':>16} {'native':>10} {'absorbed':>10} {'expanded':>10} {'best torch / native':>20}")
    gen = torch.Generator().manual_seed(1)
    cache = attn.make_cache(max(args.ctx + args.prefill) + 1, dtype)
    cases = []
    for ctx in args.ctx:  # one token at position ctx - 1 over a cache of random latents
        cache.kv[: ctx - 1] = torch.randn(ctx - 1, cache.kv.shape[1], generator=gen).to(dtype)
        cases.append((f"decode @{ctx}", torch.randn(1, hidden, generator=gen).to(dtype), ctx - 1, args.iters))
    for T in args.prefill:
        x = torch.randn(T, hidden, generator=gen).to(dtype)
        cases.append((f"prefill T={T}", x, 0, max(3, args.iters // 4)))
    with torch.inference_mode():
        for label, x, start, iters in cases:
            ms = {mode: _time_mode(attn, mode, x, cache, start, iters, args.min_s)
                  for mode in ("native", "absorbed", "expanded")}
            nat = "n/a" if ms["native"] is None else f"{ms['native']:.3f}"
            ratio = "" if ms["native"] is None else f"{min(ms['absorbed'], ms['expanded']) / ms['native']:.2f}"
            print(f"{label:>16} {nat:>10} {ms['absorbed']:10.3f} {ms['expanded']:10.3f} {ratio:>20}")
    attn.mode = "auto"
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    item = torch.tensor([], dtype=dtype).element_size()
    for shape in SHAPES:
        lat, full = kv_bytes_per_token(shape, item)
        print(f"KV bytes/token/layer ({shape}, {dtype}): latent {lat} vs expanded K+V {full} "
              f"({full / lat:.1f}x)")


if __name__ == "__main__":
    main()
