"""Gap to Belady of every cache policy over a set of route traces (the table in docs/ROUTING.md).

    python tools/policy_gaps.py OUT_DIR          # builds the traces once, then prints the table

Traces: the demo model and tiny random olmoe / qwen3-MoE (32 experts, top-4) / deepseek-v3 models, each
teacher-forced over the first 1,500 tokens of README.md and sampled for 600 tokens (temperature 1,
seed 1). Sizes per layer: top-k, E/4, E/2, 3E/4. Needs transformers (the random models).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def build_traces(out: Path) -> list[Path]:
    from hf_tiny import make_tiny_checkpoint

    import colibri
    from colibri.convert.converter import convert
    from colibri.demo import demo_model

    models = {"demo": demo_model("f32")}
    for mt, over in (("olmoe", {}), ("qwen3_moe", {"num_experts": 32, "num_experts_per_tok": 4}),
                     ("deepseek_v3", {})):
        dst = out / f"{mt}.coli"
        if not dst.exists():
            convert(make_tiny_checkpoint(mt, out / f"hf_{mt}", **over), dst, "f32", 32, progress=False)
        models[mt] = dst
    text = (ROOT / "README.md").read_text()
    traces = []
    for name, path in models.items():
        for kind in ("text", "sampled"):
            tp = out / f"{name}.{kind}.jsonl"
            traces.append(tp)
            if tp.exists():
                continue
            with colibri.load(path, ctx_size=2048, threads=1, route_trace=tp) as llm:
                if kind == "text":
                    llm.logits(llm.tokenizer.encode(text)[:1500])
                else:
                    list(llm.generate_ids(llm.tokenizer.encode("Once upon a time"), 600, temperature=1.0,
                                          seed=1, ignore_eos=True))
    return traces


class _Loader:
    """Stands in for the disk: the store's ExpertCache only needs sizes and a load that fills the slot."""

    def nbytes(self, layer: int, expert: int) -> int:
        return 1

    def load(self, layer: int, expert: int, buf):
        from colibri.layers.moe import ExpertWeights

        return ExpertWeights(gate_up=buf, down=None)


def store_hit_rate(tr, policy: str, size: int) -> float:
    """The store's own cache (colibri/store/cache.py, a pool of size x layers slots) replaying the trace."""
    from colibri.analysis import cachesim
    from colibri.store.cache import ExpertCache

    cache = ExpertCache(_Loader(), size * len(tr.layers), 64, list(tr.layers), policy=policy)
    for access in cachesim.access_sets(tr, "token"):
        for layer, ids in access:
            for _ in cache.fetch(layer, list(ids)):
                pass
    return cache.stats()["hit_rate"]


def main() -> None:
    from colibri.analysis import cachesim
    from colibri.analysis.trace import read_trace

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "policy-traces")
    out.mkdir(parents=True, exist_ok=True)
    pols = [p for p in cachesim.POLICIES if p != "belady"]
    gaps: dict = {m: {p: [] for p in pols} for m in ("per_layer", "pool")}
    store: dict = {p: [] for p in ("fair", "lru", "reuse")}
    for tp in build_traces(out):
        tr = read_trace(tp)
        e, k = max(tr.experts.values()), tr.top_k
        sim = cachesim.simulate(tr, sorted({k, max(k, e // 4), max(k, e // 2), max(k, 3 * e // 4)}))
        for mode, table in gaps.items():
            for row in sim[mode].values():
                for p in pols:
                    table[p].append(100 * (row["belady"]["hit_rate"] - row[p]["hit_rate"]))
        for size, row in sim["pool"].items():
            for p in store:
                store[p].append(100 * (row["belady"]["hit_rate"] - store_hit_rate(tr, p, size)))
    print("gap to belady, points: mean (worst) over", len(gaps["pool"][pols[0]]), "trace x size cases")
    print("| | " + " | ".join(pols) + " |")
    print("| --- " * (len(pols) + 1) + "|")
    for mode, title in (("per_layer", "per-layer caches"), ("pool", "global pool")):
        print(f"| {title} | " + " | ".join(f"{sum(v) / len(v):.1f} ({max(v):.1f})" for v in gaps[mode].values())
              + " |")
    print("\nthe store's ExpertCache replaying the same traces (a pool): gap to the simulated belady, mean (worst)")
    print("| " + " | ".join(store) + " |")
    print("| --- " * len(store) + "|")
    print("| " + " | ".join(f"{sum(v) / len(v):.1f} ({max(v):.1f})" for v in store.values()) + " |")


if __name__ == "__main__":
    main()
