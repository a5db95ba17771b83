"""Where a one-row decode step goes: time in each native kernel vs the whole step.

    .venv/bin/python benchmarks/profile_decode.py --model M.coli [--threads 2] [--steps 64] [--per-layer]
    .venv/bin/python benchmarks/profile_decode.py --model M.coli --stages   # inside the one-call step
    .venv/bin/python benchmarks/profile_decode.py --model M.coli --stages --rows 8   # 8 sequences a step

Calls the model's forward directly (no engine thread, no sampling), one row per step, and wraps the
native kernel entry points (colibri/kernels/native.py) with timers: what is left of a step is Python
and torch glue. torch.profiler cannot see the native calls (they are ctypes calls), hence this.
--stages builds the kernels with their stage timers (-DCOLI_PROF, a separate cached build; the
timers cost two clock reads per stage) and splits the one-call step (`decode_step`) into its stages
over all layers: norms, q/k/v, RoPE + KV write, attention, o_proj, routing, the expert stages, head.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--stages" in sys.argv:  # before the kernels are built: the timers are compiled in
    os.environ["COLIBRI_NATIVE_CFLAGS"] = (os.environ.get("COLIBRI_NATIVE_CFLAGS", "") + " -DCOLI_PROF").strip()

import torch  # noqa: E402

import colibri  # noqa: E402
from colibri.kernels import native, native_attn, native_mla  # noqa: E402
from colibri.layers.batch import Seq, StepBatch  # noqa: E402

KERNELS = [(native, n) for n in ("decode_step", "decode_layers", "q8_gemm", "q4_gemm", "moe", "moe_block", "route",
                                  "rmsnorm", "rope")] + [(native_attn, n) for n in ("attn_block", "attn_decode")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--per-layer", action="store_true",
                    help="the per-layer native calls, not all blocks in one (the decode plan on torch)")
    ap.add_argument("--stages", action="store_true", help="the one-call step's stages (kernel timers)")
    ap.add_argument("--rows", type=int, default=1, help="sequences per step, one row each (a batch's decode)")
    a = ap.parse_args()
    if a.stages and a.per_layer:
        ap.error("--stages times the one-call step: drop --per-layer")
    spent: dict[str, float] = {}

    def timed(name: str, fn):
        def call(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return call

    for mod, name in KERNELS:
        setattr(mod, name, timed(name, getattr(mod, name)))
    native_mla.mla_block = timed("mla_block", native_mla.mla_block)  # (DeepSeek's attention: kernels/mla.c)
    llm = colibri.load(a.model, ctx_size=a.steps + 16, threads=a.threads, slots=a.rows)
    llm.speculative = "off"  # (plain decoding: no lookup drafts in what is measured)
    if a.per_layer:
        llm.plan.rebuild(native=False)
    torch.set_num_threads(1)  # as the engine runs a decode step: the pool gets the threads
    native.set_threads(a.threads)
    slots = llm.slots.caches[: a.rows]
    rows = torch.arange(a.rows)
    with torch.inference_mode():
        def step(pos: int) -> None:  # each sequence its own slot and token, all at position pos
            batch = StepBatch([Seq(r, r + 1, pos, c) for r, c in enumerate(slots)])
            llm.plan.step(torch.tensor([3 + (pos + 7 * r) % 200 for r in range(a.rows)]), batch, rows)

        for pos in range(8):  # warm-up
            step(pos)
        spent.clear()
        native.prof_counters()  # (zeroes the stage timers)
        t0 = time.perf_counter()
        for pos in range(8, 8 + a.steps):
            step(pos)
        total = time.perf_counter() - t0
    llm.close()
    per = {k: v / a.steps * 1e3 for k, v in spent.items()}
    step_ms = total / a.steps * 1e3
    print(f"{a.model}: {a.steps} steps of {a.rows} row(s), {a.threads} threads, native kernels "
          f"{'on' if native.available() else 'off'}, load {os.getloadavg()[0]:.1f}")
    print(f"  step {step_ms:.2f} ms ({a.rows * 1e3 / step_ms:.1f} tok/s, forward only)")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<12} {v:6.3f} ms  {v / step_ms:5.1%}")
    rest = step_ms - sum(per.values())
    print(f"  {'other':<12} {rest:6.3f} ms  {rest / step_ms:5.1%}  (Python, torch ops, KV writes)")
    if a.stages:
        stages(a.steps, step_ms)


def stages(n: int, step_ms: float) -> None:
    prof = native.prof_counters()
    if prof is None:
        sys.exit("the kernels were built without their stage timers")
    times, steps = prof
    if steps != n:
        sys.exit(f"{steps} of the {n} steps ran as one native call (engine/decode_plan.py): no stage split")
    print("  inside decode_step, all layers (us per step):")
    for name, sec in times.items():
        us = sec / n * 1e6
        print(f"    {name:<16} {us:8.1f} us  {us / 1e3 / step_ms:5.1%}")
    inside = sum(times.values()) / n * 1e3
    print(f"    {'(sum)':<16} {inside * 1e3:8.1f} us  {inside / step_ms:5.1%}  (the rest of decode_step: embedding, "
          "buffers, the copies between stages)")


if __name__ == "__main__":
    main()
