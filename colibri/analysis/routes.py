"""`colibri routes`: what the routers did, from a route trace or by running a model over a text.

    colibri routes TRACE.jsonl [--plot out.png] [--json]
    colibri routes --model M.coli --file text.txt [--route-trace out.jsonl]
    colibri routes TRACE.jsonl --reference GOOD.jsonl       # flags a scrambled expert order
    colibri routes TRACE.jsonl --simulate --cache-sizes 4,8,16,32

Per MoE layer: the expert load histogram (share of tokens routed to each expert; the shares sum to
top-k), entropy against the uniform router's, the top experts and how concentrated the load is,
the pairs chosen together most often (against chance), how often consecutive tokens reuse an expert,
and the tokens whose routing is least likely under the layers' average distributions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import ColibriError
from .trace import RouteTrace, read_trace


def choices(tr: RouteTrace, layer: int, E: int = 0) -> np.ndarray:
    """Each expert's count of (token, slot) choices in `layer` [E]; a slot of weight exactly 0 is no choice (LongCat's
    zero-computation experts reach the experts as weight-0 repeats of a real one)."""
    ids, w = tr.ids[layer], tr.w.get(layer)
    live = None if w is None or w.shape != ids.shape else (w.ravel() != 0).astype(np.int64)
    return np.bincount(ids.ravel(), weights=live, minlength=E).astype(np.int64)


def layer_stats(tr: RouteTrace, layer: int, top: int = 5) -> dict:
    ids = tr.ids[layer]  # [N, k]
    N, k = ids.shape
    E = max(tr.experts.get(layer, 0), int(ids.max()) + 1 if ids.size else 0)
    counts = choices(tr, layer, E)  # [E]
    share = counts / max(N, 1)  # share of tokens that chose each expert (sums to k)
    p = counts / max(counts.sum(), 1)
    nz = p[p > 0]
    entropy = float(-(nz * np.log2(nz)).sum())
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(p[order])
    quarter = max(1, E // 4)
    # Pairs: tokens choosing both i and j, against the independent-choice expectation share_i * share_j.
    onehot = np.zeros((N, E), dtype=np.float32)
    np.put_along_axis(onehot, ids, 1.0, axis=1)
    both = onehot.T @ onehot  # [E, E]
    pairs = []
    for i in range(E):
        for j in range(i + 1, E):
            if both[i, j] > 0:
                lift = (both[i, j] / N) / (share[i] * share[j]) if share[i] * share[j] > 0 else 0.0
                pairs.append((int(both[i, j]), float(lift), i, j))
    pairs.sort(key=lambda x: (-x[0], -x[1]))
    reuse, chance = consecutive_reuse(tr, layer), float((share**2).sum() / k) if k else 0.0
    return {
        "tokens": int(N), "experts": int(E), "top_k": int(k),
        "load": [round(float(x), 5) for x in share],
        "entropy_bits": round(entropy, 4), "uniform_bits": round(math.log2(E), 4) if E else 0.0,
        "entropy_ratio": round(entropy / math.log2(E), 4) if E > 1 else 1.0,
        "top": [{"expert": int(e), "share": round(float(share[e]), 4)} for e in order[:top]],
        "experts_for_half": int(np.searchsorted(cum, 0.5) + 1),
        "experts_for_80pct": int(np.searchsorted(cum, 0.8) + 1),
        "top_quarter_share": round(float(cum[quarter - 1]), 4),
        "unused": int((counts == 0).sum()),
        "pairs": [{"experts": [i, j], "tokens": c, "lift": round(lift, 3)} for c, lift, i, j in pairs[:top]],
        "consecutive_reuse": None if reuse is None else round(reuse, 4),
        "reuse_by_chance": round(chance, 4),
    }


def consecutive_reuse(tr: RouteTrace, layer: int) -> float | None:
    """Mean share of a token's experts that the previous token of the same request also chose."""
    ids = tr.ids[layer]
    same = n = 0
    for rows in tr.sequences():
        if len(rows) < 2:
            continue
        a, b = ids[rows[:-1]], ids[rows[1:]]  # [n-1, k] each
        same += int((a[:, :, None] == b[:, None, :]).any(2).sum())
        n += b.size
    return same / n if n else None


def unusual_tokens(tr: RouteTrace, n: int = 8) -> list[dict]:
    """Rows whose routing is least likely under each layer's average distribution: the mean over
    layers and chosen experts of log2 P(expert) (P = the layer's load, normalised)."""
    if not tr.ids or tr.n_rows == 0:
        return []
    score = np.zeros(tr.n_rows)
    rarest = {}
    for lay in tr.layers:
        ids = tr.ids[lay]
        counts = choices(tr, lay, tr.experts.get(lay, 0))
        logp = np.log2(np.maximum(counts, 1) / counts.sum())  # every chosen expert has count >= 1
        lp = logp[ids]  # [N, k]
        score += lp.mean(1)
        rarest[lay] = lp.argmin(1)
    score /= len(tr.layers)
    out = []
    for i in np.argsort(score, kind="stable")[:n]:
        i = int(i)
        out.append({"request": tr.req[i], "pos": int(tr.pos[i]), "tok": int(tr.tok[i]), "text": tr.text[i],
                    "log2p": round(float(score[i]), 3),
                    "experts": {str(lay): tr.ids[lay][i].tolist() for lay in tr.layers}})
    return out


def analyse(tr: RouteTrace, top: int = 5) -> dict:
    return {"tokens": tr.n_rows, "requests": len(set(tr.req)), "moe_layers": tr.layers, "top_k": tr.top_k,
            "layers": {str(lay): layer_stats(tr, lay, top) for lay in tr.layers},
            "unusual": unusual_tokens(tr, top)}


# ---------------------------------------------------------------------- against a reference


def compare(tr: RouteTrace, ref: RouteTrace, threshold: float = 0.9) -> dict:
    """Per layer, the share of experts both traces chose for the same token (matched by request order,
    position and token id). The routers agree exactly up to the layer whose *input* is damaged, so the
    first layer that disagrees points at the block just before it (a scrambled expert order there gives
    every router up to and including its own layer the same inputs, and the next one garbage)."""
    def keyed(t: RouteTrace) -> dict:
        order = {r: n for n, r in enumerate(dict.fromkeys(t.req))}
        return {(order[r], int(p), int(k)): i for i, (r, p, k) in enumerate(zip(t.req, t.pos, t.tok))}

    a, b = keyed(tr), keyed(ref)
    common = [(a[key], b[key]) for key in a.keys() & b.keys()]
    if not common:
        raise ColibriError("the trace and the reference share no token (run both over the same text)")
    ia, ib = np.array([c[0] for c in common]), np.array([c[1] for c in common])
    agree = {}
    for lay in tr.layers:
        if lay not in ref.ids:
            continue
        x, y = tr.ids[lay][ia], ref.ids[lay][ib]  # [M, k]
        agree[lay] = float((x[:, :, None] == y[:, None, :]).any(2).mean())
    # The first clear drop: below `threshold`, or any loss right after layers that agreed exactly
    # (same model, same scheme: a subtle scramble, e.g. two rarely used experts swapped).
    first_bad, exact = None, True
    for lay in sorted(agree):
        if agree[lay] < threshold or (exact and agree[lay] < 0.99):
            first_bad = lay
            break
        exact = exact and agree[lay] >= 0.9999
    out = {"tokens": len(common), "agreement": {str(k): round(v, 4) for k, v in agree.items()},
           "first_disagreeing_layer": first_bad, "suspect_layer": None, "verdict": "routing matches the reference"}
    if first_bad is not None:
        before = [lay for lay in sorted(agree) if lay < first_bad]
        suspect = before[-1] if before else None
        out["suspect_layer"] = suspect
        where = (f"the experts of layer {suspect} (or layer {first_bad}'s attention)" if suspect is not None
                 else f"a block before layer {first_bad} (embeddings or attention)")
        out["verdict"] = (f"routing diverges from the reference at layer {first_bad} "
                          f"({100 * agree[first_bad]:.0f}% of experts agree) after matching before it: suspect "
                          f"{where} -- e.g. a scrambled expert order")
    return out


# ---------------------------------------------------------------------- printing and plotting


def format_report(rep: dict, top: int = 5) -> list[str]:
    lines = [f"{rep['tokens']} tokens in {rep['requests']} request(s), {len(rep['moe_layers'])} MoE layers, "
             f"top-{rep['top_k']}"]
    for lay, s in rep["layers"].items():
        E = s["experts"]
        lines.append(f"layer {lay}: {E} experts, entropy {s['entropy_bits']:.2f} of {s['uniform_bits']:.2f} bits "
                     f"({100 * s['entropy_ratio']:.0f}% of uniform); half the load on {s['experts_for_half']}, "
                     f"80% on {s['experts_for_80pct']}; top quarter takes {100 * s['top_quarter_share']:.0f}%"
                     + (f"; {s['unused']} never used" if s["unused"] else ""))
        lines.append("  top: " + ", ".join(f"e{t['expert']} {100 * t['share']:.1f}%" for t in s["top"])
                     + " of tokens")
        lines.append("  load: " + " ".join(f"{100 * x:.0f}" for x in s["load"]) + "  (% of tokens per expert)")
        if s["pairs"]:
            lines.append("  pairs: " + ", ".join(f"e{p['experts'][0]}+e{p['experts'][1]} {p['tokens']} tok "
                                                 f"(x{p['lift']:.2f} chance)" for p in s["pairs"][:3]))
        if s["consecutive_reuse"] is not None:
            lines.append(f"  consecutive tokens reuse {100 * s['consecutive_reuse']:.0f}% of experts "
                         f"(chance {100 * s['reuse_by_chance']:.0f}%)")
    if rep["unusual"]:
        lines.append("most unusual routing (mean log2 P under the layers' average load):")
        for u in rep["unusual"][:top]:
            lines.append(f"  [{u['request']} pos {u['pos']} tok {u['tok']} {u['text']!r}] {u['log2p']:.2f}: "
                         + " ".join(f"L{lay}={'/'.join(map(str, e))}" for lay, e in u["experts"].items()))
    return lines


def plot(rep: dict, path: str) -> None:
    """Layer x expert heat map of the load, and each layer's concentration."""
    try:
        import matplotlib
    except ImportError:
        raise ColibriError("--plot needs matplotlib (pip install 'colibri[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(rep["layers"])
    E = max(s["experts"] for s in rep["layers"].values())
    heat = np.full((len(layers), E), np.nan)
    for i, lay in enumerate(layers):
        load = rep["layers"][lay]["load"]
        heat[i, : len(load)] = load
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    im = ax0.imshow(heat, aspect="auto", cmap="viridis", interpolation="nearest")
    ax0.set_xlabel("expert")
    ax0.set_ylabel("MoE layer")
    ax0.set_yticks(range(len(layers)), layers)
    ax0.set_title("share of tokens routed to each expert")
    fig.colorbar(im, ax=ax0, fraction=0.04)
    x = np.arange(len(layers))
    ent = [rep["layers"][lay]["entropy_ratio"] for lay in layers]
    quarter = [rep["layers"][lay]["top_quarter_share"] for lay in layers]
    ax1.bar(x - 0.2, ent, 0.4, label="entropy / uniform")
    ax1.bar(x + 0.2, quarter, 0.4, label="load on top 25% experts")
    ax1.set_xticks(x, layers)
    ax1.set_xlabel("MoE layer")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("concentration per layer")
    ax1.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------- running a model


class LookAhead:
    """What the store's look-ahead predicts: the next MoE layer's router (L+1's, or past the dense layers
    between) applied to MoE layer L's residual after attention (the input of L's post-attention norm), per
    row, keyed by the predicted layer (store/lookahead.py). `take()` after each forward."""

    def __init__(self, model):
        import functools

        from ..store.lookahead import is_routed  # (here: reading a trace needs no torch)

        self.preds: dict[int, object] = {}
        self.handles = []
        blocks = model.model.layers
        routed = [L for L, b in enumerate(blocks) if is_routed(b)]
        for L, N in zip(routed, routed[1:]):
            here, nxt = blocks[L].post_attention_layernorm, blocks[N]
            self.handles.append(here.register_forward_pre_hook(
                functools.partial(self._hook, nxt.post_attention_layernorm, nxt.mlp.gate, N)))

    def _hook(self, norm, gate, layer: int, module, args) -> None:
        h = args[0]  # [T, H]
        self.preds[layer] = gate(norm(h.to(gate.weight.device)))[0].cpu()  # [T, k]

    def take(self) -> dict:
        out, self.preds = self.preds, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def trace_text(llm, text: str, window: int | None = None) -> RouteTrace:
    """Run the engine teacher-forced over `text` (windows of the context size) and collect the trace,
    look-ahead predictions included."""
    from ..layers.moe import SwitchGLU
    from .trace import RouteCollector

    ids = llm.tokenizer.encode(text)
    if not ids:
        raise ColibriError("the text has no tokens")
    window = window or llm.ctx_size
    experts = {m.layer: m.num_experts for m in llm.model.modules() if isinstance(m, SwitchGLU)}
    nbytes = {}
    for lay in experts:
        for name in (f"model.layers.{lay}.mlp.experts.0", f"model.layers.{lay}.block_sparse_moe.experts.0"):
            if llm.container.has_record(name):
                nbytes[lay] = llm.container.record(name)["nbytes"]
                break
    look = LookAhead(llm.model)
    col = RouteCollector(llm.tokenizer, experts=experts, model=str(llm.container.path), expert_bytes=nbytes,
                         prediction=look.take)
    llm.add_step_listener(col)
    try:
        for i in range(0, len(ids), window):
            llm.submit(ids[i : i + window], 0).wait()
        # A request is done before its last step's listeners run: wait for that step to be recorded.
        deadline = time.monotonic() + 30
        while sum(len(r["rows"]) for r in col.records) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.002)
    finally:
        llm.remove_step_listener(col)
        look.remove()
    return col.trace()


# ---------------------------------------------------------------------- the command


def parser() -> argparse.ArgumentParser:
    from ..cli.common import HelpFormatter, add_engine_args

    p = argparse.ArgumentParser(prog="colibri routes", formatter_class=HelpFormatter,
                                description="Routing statistics per MoE layer from a route trace (--route-trace), "
                                            "or by running --model over --file; cache-policy simulation.")
    p.add_argument("trace", nargs="?", help="a route trace file (JSON lines, docs/ROUTING.md)")
    p.add_argument("--file", "-f", help="with --model: run the model over this text and analyse its routing")
    p.add_argument("--top", type=int, default=5, help="top experts, pairs and unusual tokens to list")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--plot", metavar="PNG", help="draw a layer x expert heat map and per-layer concentration")
    p.add_argument("--reference", metavar="TRACE",
                   help="a trace of a known-good model over the same text: per-layer agreement, and the first "
                        "layer that diverges (a scrambled expert order shows here)")
    s = p.add_argument_group("cache simulation")
    s.add_argument("--simulate", action="store_true", help="replay the trace against expert caches")
    s.add_argument("--cache-sizes", default=None, metavar="N,N,...",
                   help="expert slots per layer to simulate (default: top-k, E/4, E/2, 3E/4)")
    s.add_argument("--unit", choices=["token", "step"], default="token",
                   help="an access is one token's experts (a decoding stream) or one step's union (as run)")
    s.add_argument("--train", metavar="TRACE", help="trace to learn the hot set from (default: this one)")
    s.add_argument("--horizons", default=None, metavar="N,N,...",
                   help="also simulate the reuse policy told the exact routes of the next N tokens (not online: "
                        "how much future coming near Belady would need)")
    add_engine_args(p)
    return p


def _sizes(text: str | None, tr: RouteTrace) -> list[int]:
    E = min(tr.experts.values()) if tr.experts else 0
    if text is None:
        k = tr.top_k
        cand = [k, E // 4, E // 2, 3 * E // 4]
        return sorted({c for c in cand if 0 < c < E}) or [max(1, k)]
    return _counts(text, "--cache-sizes")


def _counts(text: str | None, flag: str) -> list[int]:
    if text is None:
        return []
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ColibriError(f"{flag} must be integers separated by commas, got {text!r}") from None
    if not out or out[0] < 1:
        raise ColibriError(f"{flag} must be positive, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    from ..cli.common import engine_from_args, setup_logging
    from . import cachesim

    a = parser().parse_args(argv)
    setup_logging(a.log_level)
    if (a.trace is None) == (a.file is None):
        raise ColibriError("give a route trace file, or --model M --file TEXT (one of them)")
    horizons = _counts(a.horizons, "--horizons")  # (before a model runs: a typo fails at once)
    if a.file is not None:
        try:
            text = Path(a.file).read_text()
        except OSError as e:
            raise ColibriError(f"cannot read {a.file}: {e.strerror}") from None
        llm = engine_from_args(a)
        try:
            tr = trace_text(llm, text)
        finally:
            llm.close()
    else:
        tr = read_trace(a.trace)
    if tr.n_rows == 0:
        raise ColibriError("the trace has no tokens")
    rep = analyse(tr, a.top)
    lines = format_report(rep, a.top)
    if a.reference:
        rep["reference"] = compare(tr, read_trace(a.reference))
        r = rep["reference"]
        lines.append(f"against the reference ({r['tokens']} tokens): experts agreeing per layer "
                     + ", ".join(f"L{k} {100 * v:.0f}%" for k, v in r["agreement"].items()))
        lines.append(("WARNING: " if r["first_disagreeing_layer"] is not None else "") + r["verdict"])
    if a.simulate:
        train = read_trace(a.train) if a.train else None
        sim = cachesim.simulate(tr, _sizes(a.cache_sizes, tr), unit=a.unit, train=train,
                                horizons=horizons)
        sim["lookahead"] = {str(k): v for k, v in cachesim.lookahead(tr).items()}
        rep["simulate"] = sim
        lines += cachesim.format_table(sim)
        lines.append("look-ahead recall of the next layer's experts: " + "; ".join(
            f"L{k}: " + ", ".join(f"{n.replace('_', ' ')} {100 * v:.0f}%" for n, v in r.items() if v is not None)
            for k, r in sim["lookahead"].items()))
    if a.plot:
        plot(rep, a.plot)
        lines.append(f"plot written to {a.plot}")
    if a.json:
        print(json.dumps(rep))
    else:
        print("\n".join(lines))
    sys.stdout.flush()
    return 0
