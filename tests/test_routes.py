"""Routing tools: the labelled debug log, the route trace (and its engine-free reader), `colibri routes`
statistics and plot, the cache-policy simulator, and scrambled-expert detection against a reference."""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri.analysis import cachesim
from colibri.analysis.routes import analyse, compare
from colibri.analysis.trace import RouteTrace, read_trace
from colibri.cli import main
from colibri.format.container import _PREAMBLE

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\[(\S+) pos (\d+) tok (\d+) (.*)\] layer +(\d+): (.*)$")
TEXT = ("Once upon a time there was a little girl who lived in a small house near the woods. Every morning "
        "she walked to the river to fetch water, and every evening she sat by the fire.")


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------- debug log and trace


@pytest.mark.parametrize("n", [1, 4])
def test_debug_log_labels_every_prompt_and_generated_token(ckpt, capsys, tmp_path, n):
    model = str(ckpt.coli("mixtral", "f32"))  # 3 layers, all MoE, 4 experts, top-2
    trace = tmp_path / "t.jsonl"
    rc, out, err = run(["-m", model, "-p", "Hello there", "-n", str(n), "--temp", "0", "--ignore-eos",
                        "--log-level", "debug", "--route-trace", str(trace), "--threads", "1"], capsys)
    assert rc == 0
    llm = colibri.load(model, ctx_size=32)
    prompt = llm.tokenizer.encode("Hello there")
    lines = [m.groups() for ln in err.splitlines() if (m := LINE.match(ln))]
    P, L = len(prompt), 3
    assert len(lines) == (P + n) * L  # every prompt token and every generated one, once per MoE layer
    by_pos: dict[int, list] = {}
    for req, pos, tok, text, layer, pairs in lines:
        by_pos.setdefault(int(pos), []).append((req, int(tok), text, int(layer), pairs))
    assert sorted(by_pos) == list(range(P + n))
    assert len({r for v in by_pos.values() for r, *_ in v}) == 1  # one request id labels them all
    toks = [by_pos[p][0][1] for p in range(P + n)]
    assert toks[:P] == prompt
    assert llm.tokenizer.decode(toks[P:]) == out.rstrip("\n")  # the generated tokens, first and last included
    for entries in by_pos.values():
        assert sorted(e[3] for e in entries) == [0, 1, 2]
        assert all(e[2] == repr(llm.tokenizer.decode([e[1]], skip_special_tokens=False)) for e in entries)
        for *_, pairs in entries:
            ws = [(int(e), float(w)) for e, w in (x.split(":") for x in pairs.split())]
            assert len(ws) == 2 and all(0 <= e < 4 for e, _ in ws)
            assert sum(w for _, w in ws) == pytest.approx(1.0, abs=2e-3)  # mixtral renormalises its top-k
    llm.close()
    # The trace holds the same decisions as the log.
    tr = read_trace(trace)
    assert tr.n_rows == P + n and tr.pos.tolist() == list(range(P + n)) and tr.tok.tolist() == toks
    for *_, pos, _tok, _text, layer, pairs in lines:
        ids = [int(x.split(":")[0]) for x in pairs.split()]
        assert tr.ids[int(layer)][int(pos)].tolist() == ids


def _doc_reader() -> str:
    doc = (ROOT / "docs" / "ROUTING.md").read_text()
    return re.search(r"```python\n(# Reading a trace without colibri.*?)```", doc, re.S).group(1)


def test_trace_is_append_only_and_readable_without_colibri(ckpt, tmp_path):
    path = tmp_path / "trace.jsonl"
    model = ckpt.coli("olmoe", "f32")
    for prompts in (["Once upon"], ["a time", "there was a"]):
        with colibri.load(model, ctx_size=64, slots=2, route_trace=path) as llm:
            llm.generate_batch(prompts, max_tokens=3, temperature=0, ignore_eos=True)
    tr = read_trace(path)
    assert len(tr.headers) == 2  # two runs appended, each with its header
    assert len(set(tr.req)) == 3 and tr.n_rows == sum(len(llm.tokenizer.encode(p)) + 3
                                                     for p in ("Once upon", "a time", "there was a"))
    for lay in tr.layers:
        assert tr.ids[lay].shape == (tr.n_rows, 2) and (tr.w[lay] > 0).all()
    # The docs' reader needs only json + numpy and gives the same arrays.
    scope: dict = {}
    exec(compile(_doc_reader(), "ROUTING.md", "exec"), scope)
    rows, ids, weights = scope["read_trace"](str(path))
    assert len(rows) == tr.n_rows
    for lay in tr.layers:
        assert np.array_equal(ids[lay], tr.ids[lay]) and np.allclose(weights[lay], tr.w[lay])


# ---------------------------------------------------------------------- analysis


def _synthetic(rows_ids: list[list[tuple[int, int]]], E: int = 4) -> RouteTrace:
    """One request; rows_ids[t] = per layer the (e1, e2) chosen by token t."""
    recs = [{"format": "colibri-route-trace", "version": 1, "experts": {"0": E, "1": E}}]
    for t, per_layer in enumerate(rows_ids):
        recs.append({"step": t, "rows": [["r", t, 10 + t, f"t{t}"]],
                     "ids": {str(lay): [list(p)] for lay, p in enumerate(per_layer)},
                     "w": {str(lay): [[0.6, 0.4]] for lay in range(len(per_layer))}})
    return RouteTrace.from_records(recs)


def test_statistics_on_a_known_trace():
    # Layer 0: always experts 0 and 1; layer 1: alternates between (0, 1) and (2, 3); token 5 is odd.
    rows = [[(0, 1), (0, 1) if t % 2 == 0 else (2, 3)] for t in range(10)]
    rows[5] = [(2, 3), (0, 1)]
    rep = analyse(_synthetic(rows))
    l0, l1 = rep["layers"]["0"], rep["layers"]["1"]
    assert l0["load"] == [0.9, 0.9, 0.1, 0.1] and sum(l1["load"]) == pytest.approx(2.0)
    assert l0["entropy_bits"] == pytest.approx(-2 * (0.45 * np.log2(0.45) + 0.05 * np.log2(0.05)), abs=1e-3)
    assert l0["uniform_bits"] == 2.0 and l0["top"][0] == {"expert": 0, "share": 0.9}
    assert l0["pairs"][0] == {"experts": [0, 1], "tokens": 9, "lift": round(0.9 / 0.81, 3)}
    assert l0["consecutive_reuse"] == pytest.approx(7 / 9, abs=1e-4)  # 4 -> 5 and 5 -> 6 break the run
    assert l1["consecutive_reuse"] == pytest.approx(2 / 9, abs=1e-4)  # only 4 -> 5 -> 6 keep (0, 1)
    assert rep["unusual"][0]["pos"] == 5  # the rare (2, 3) in layer 0


def test_weight_zero_slots_are_not_counted_as_choices():
    """LongCat's zero-computation experts reach the routing hook as weight-0 repeats of a real expert: the load counts
    the real choices only (and a repeat adds no pair)."""
    recs = [{"format": "colibri-route-trace", "version": 1, "experts": {"0": 4}}]
    for t, (ids, w) in enumerate([((0, 1), (0.6, 0.4)), ((2, 2), (0.7, 0.0)), ((3, 3), (0.0, 0.0))]):
        recs.append({"step": t, "rows": [["r", t, 10 + t, f"t{t}"]], "ids": {"0": [list(ids)]}, "w": {"0": [list(w)]}})
    rep = analyse(RouteTrace.from_records(recs))["layers"]["0"]
    assert rep["load"] == [round(1 / 3, 5), round(1 / 3, 5), round(1 / 3, 5), 0.0]
    assert rep["unused"] == 1 and [p["experts"] for p in rep["pairs"]] == [[0, 1]]


def test_routes_cli_text_json_and_plot(ckpt, capsys, tmp_path):
    model = str(ckpt.coli("qwen3_moe", "f32"))
    text, trace, png = tmp_path / "in.txt", tmp_path / "t.jsonl", tmp_path / "r.png"
    text.write_text(TEXT)
    rc, out, err = run(["routes", "-m", model, "--file", str(text), "--route-trace", str(trace), "--threads", "1",
                        "--plot", str(png)], capsys)
    assert rc == 0 and "layer 0: 8 experts, entropy" in out and "most unusual routing" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 100_000
    rc, out, _ = run(["routes", str(trace), "--json"], capsys)
    rep = json.loads(out)
    assert rep["tokens"] == len(colibri.load(model).tokenizer.encode(TEXT))
    for s in rep["layers"].values():
        assert sum(s["load"]) == pytest.approx(2.0, abs=1e-3)  # shares of tokens sum to top-k
        assert 0 < s["entropy_bits"] <= s["uniform_bits"] == 3.0


def test_routes_refuses_bad_input(capsys, tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"hello": 1}\n{"step": 0}\n')
    rc, _, err = run(["routes", str(bad)], capsys)
    assert rc == 1 and "not a colibri route trace" in err and "Traceback" not in err
    rc, _, err = run(["routes"], capsys)
    assert rc == 1 and "give a route trace file" in err
    rc, _, err = run(["routes", str(bad), "--simulate", "--horizons", "two"], capsys)
    assert rc == 1 and "--horizons must be integers" in err and "Traceback" not in err


# ---------------------------------------------------------------------- cache simulation


def _random_trace(seed: int, n: int = 300, E: int = 16, k: int = 2, L: int = 3) -> RouteTrace:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 0.3), size=L)  # skewed per-layer preferences
    rows = []
    for _ in range(n):
        rows.append([tuple(int(x) for x in rng.choice(E, k, replace=False, p=p[lay])) for lay in range(L)])
    recs = [{"format": "colibri-route-trace", "version": 1, "experts": {str(lay): E for lay in range(L)}}]
    recs += [{"step": t, "rows": [["r", t, 1, ""]], "ids": {str(lay): [list(r[lay])] for lay in range(L)},
              "w": {str(lay): [[0.5] * k] for lay in range(L)}} for t, r in enumerate(rows)]
    return RouteTrace.from_records(recs)


def test_belady_bounds_every_policy():
    for seed in range(3):
        sim = cachesim.simulate(_random_trace(seed), [2, 4, 8], horizons=(1, 4))
        assert list(sim["pool"][2])[-3:] == ["horizon-1", "horizon-4", "belady"]
        for mode in ("per_layer", "pool"):
            for size, row in sim[mode].items():
                best = row["belady"]["hit_rate"]
                assert all(r["hit_rate"] <= best + 1e-12 for r in row.values()), (mode, size, row)
                assert row["belady"]["reads_per_token"] == pytest.approx((1 - best) * 2 * 3)


def test_belady_bounds_every_policy_when_a_step_needs_more_than_the_cache():
    # Steps of 4 rows: a layer's union (up to 8 experts) can exceed 2 or 4 slots, so the set's own
    # experts must evict each other (Belady had kept the wrong one then and fell below LRU).
    tr = _random_trace(5, n=240, k=2)
    tr.step = np.arange(tr.n_rows) // 4
    sim = cachesim.simulate(tr, [2, 4], unit="step")
    for mode in ("per_layer", "pool"):
        for size, row in sim[mode].items():
            best = row["belady"]["hit_rate"]
            assert all(r["hit_rate"] <= best + 1e-12 for r in row.values()), (mode, size, row)
    c = cachesim.make_cache("lfu", 2, [0], [])
    c.serve(((0, 1), (0, 2)), 0)
    c.serve(((0, 1),), 1)
    c.serve(((0, 3), (0, 1), (0, 4)), 2)  # 1 hits (3 uses); 3 evicts 2 (not being served); 4 must evict a
    assert set(c.score) == {(0, 1), (0, 4)}  # served one: the lower-scored, 3 (1 use), not 1


def test_policies_on_a_hand_checked_sequence():
    seq = [(0, (e,)) for e in (1, 2, 3, 1, 4, 1, 2)]  # one layer, one expert per access
    hits = {p: cachesim.replay(cachesim.make_cache(p, 2, [0], seq), seq)[0] for p in ("lru", "lfu", "belady")}
    # lru: 1 2 | 3 evicts 1 | 1 evicts 2 | 4 evicts 3 | 1 hits | 2 misses -> 1 hit
    # lfu (counts over all history, ties by recency): 3 evicts 1, 1 evicts 2, 4 evicts 3, 1 hits -> 1 hit
    # belady: 3 evicts 2 (needed last), 1 hits, 4 evicts 3 (never again), 1 hits -> 2 hits
    assert hits == {"lru": 1, "lfu": 1, "belady": 2}
    pool = cachesim.make_cache("fair", 4, [0, 1], [])  # two layers, two slots each
    for t, key in enumerate([(0, 1), (0, 2), (1, 5), (0, 3), (1, 6), (0, 1)]):
        pool.serve((key,), t)
    assert len(pool.layer[0]) == 2 and len(pool.layer[1]) == 2  # layer 0 evicted its own, not layer 1's


def test_horizon_knows_the_next_tokens():
    # One layer, two slots, experts 0 1 2 in a cycle: knowing one access ahead, the resident not needed next
    # goes, as Belady's choice (a hit every other access once warm); LRU and the estimate keep the wrong one.
    seq = [(0, (t % 3,)) for t in range(90)]
    hits = {p: cachesim.replay(cachesim.make_cache(p, 2, [0], seq), seq)[0]
            for p in ("lru", "reuse", "horizon-1", "belady")}
    assert hits["horizon-1"] == hits["belady"] == 44 and hits["lru"] == 0 and hits["reuse"] < 44
    # With no window it is the estimate alone: the reuse policy's choices, access for access.
    tr = _random_trace(7)
    seq = [a for s in cachesim.access_sets(tr) for a in s]
    got = {p: cachesim.replay(cachesim.make_cache(p, 6, tr.layers, seq), seq) for p in ("reuse", "horizon-0")}
    assert got["reuse"] == got["horizon-0"]


def test_reuse_keeps_the_expert_that_keeps_coming_back():
    # One layer, two slots: expert 0 every third access, the others never twice. LRU drops 0 each time
    # two strangers pass; the reuse estimate learns 0's rate and keeps it, as Belady does.
    strangers = iter(range(1, 1000))
    seq = [(0, (0,)) if i % 3 == 0 else (0, (next(strangers),)) for i in range(300)]
    hits = {p: cachesim.replay(cachesim.make_cache(p, 2, [0], seq), seq)[0] for p in ("lru", "reuse", "belady")}
    assert hits["lru"] == 0
    assert hits["belady"] == 99
    assert hits["reuse"] >= 95  # all but the first few, while the rate is being learned


def test_reuse_moves_slots_to_the_layer_that_reuses():
    # Two layers sharing 3 slots: layer 0 reuses expert 7 every token, layer 1 never repeats.
    # Equal shares (fair) give each layer 1.5 slots; reuse keeps layer 0's expert for good.
    strangers = iter(range(1000))
    seq = [a for _ in range(200) for a in ((0, (7, next(strangers) + 100)), (1, (next(strangers),)))]
    rate = {}
    for p in ("fair", "reuse", "belady"):
        h, n, _ = cachesim.replay(cachesim.make_cache(p, 3, [0, 1], seq), seq)
        rate[p] = h / n
    assert rate["reuse"] >= rate["belady"] - 0.01 > rate["fair"]


def test_simulate_cli_with_lookahead(ckpt, capsys, tmp_path):
    model = str(ckpt.coli("olmoe", "f32"))
    text = tmp_path / "in.txt"
    text.write_text(TEXT)
    rc, out, _ = run(["routes", "-m", model, "--file", str(text), "--threads", "1", "--simulate",
                      "--cache-sizes", "2,4", "--horizons", "2", "--json"], capsys)
    assert rc == 0
    sim = json.loads(out)["simulate"]
    assert set(sim["pool"]["4"]) == set(cachesim.POLICIES) | {"horizon-2"}
    assert all("bytes_per_token" in r for r in sim["per_layer"]["2"].values())  # expert sizes from the model
    la = sim["lookahead"]
    assert la["0"]["router_lookahead"] is None if "router_lookahead" in la["0"] else True  # nothing predicts layer 0
    for lay in ("1", "2"):
        assert 0.0 < la[lay]["router_lookahead"] <= 1.0 and 0.0 <= la[lay]["same_as_last_token"] <= 1.0


# ---------------------------------------------------------------------- scrambled experts


def scramble(src: Path, dst: Path, layer: int, perm: list[int]) -> None:
    """Rewrite the header so that expert e of `layer` points at expert perm[e]'s record."""
    raw = src.read_bytes()
    magic, ver, flags, h_off, h_len, _, _ = _PREAMBLE.unpack_from(raw)
    h = json.loads(raw[h_off : h_off + h_len])
    recs, tens = h["records"], h["tensors"]
    prefix = f"model.layers.{layer}.mlp.experts."
    old = {e: (recs[f"{prefix}{e}"], {sub: tens[full] for sub, full in recs[f"{prefix}{e}"]["tensors"].items()})
           for e in range(len(perm))}
    for e, src_e in enumerate(perm):
        rec, members = old[src_e]
        name = f"{prefix}{e}"
        recs[name] = {**rec, "tensors": {sub: f"{name}.{sub}" for sub in members}}
        for sub, t in members.items():
            tens[f"{name}.{sub}"] = {**t, "record": name}
    data = json.dumps(h, separators=(",", ":")).encode()
    pre = _PREAMBLE.pack(magic, ver, flags, h_off, len(data), zlib.crc32(data), h_off + len(data))
    dst.write_bytes(pre + raw[struct.calcsize(_PREAMBLE.format) : h_off] + data)


def test_scrambled_expert_order_is_flagged_against_a_reference(ckpt, capsys, tmp_path):
    good = ckpt.coli("olmoe", "f32")  # 3 MoE layers, 8 experts
    bad = tmp_path / "scrambled.coli"
    scramble(good, bad, 1, [3, 0, 1, 2, 7, 4, 5, 6])
    text = tmp_path / "in.txt"
    text.write_text(TEXT)
    traces = {}
    for name, m in (("good", good), ("again", good), ("bad", bad)):
        traces[name] = tmp_path / f"{name}.jsonl"
        assert run(["routes", "-m", str(m), "--file", str(text), "--route-trace", str(traces[name]),
                    "--threads", "1"], capsys)[0] == 0
    r = compare(read_trace(traces["again"]), read_trace(traces["good"]))
    assert r["first_disagreeing_layer"] is None and set(r["agreement"].values()) == {1.0}
    rc, out, _ = run(["routes", str(traces["bad"]), "--reference", str(traces["good"])], capsys)
    assert rc == 0
    assert "WARNING: routing diverges from the reference at layer 2" in out and "experts of layer 1" in out
    r = compare(read_trace(traces["bad"]), read_trace(traces["good"]))
    assert r["agreement"]["0"] == r["agreement"]["1"] == 1.0  # the routers before the damage agree exactly
    assert r["agreement"]["2"] < 0.9 and r["suspect_layer"] == 1
