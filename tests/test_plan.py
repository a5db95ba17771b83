"""The planner's arithmetic on synthetic headers, the usage file, and both on a real tiny container."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

import colibri
from colibri.analysis.probe import GiB, Machine, MiB, measure_disk, measure_matvec, measure_op
from colibri.analysis.usage import Recorder, Usage
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.plan import (
    DEFAULT_CTX,
    OUR_RAM_HEADROOM,
    PIN_SHARE,
    PY_PER_OP,
    RUNTIME_BYTES,
    PlanSizes,
    auto_placement,
    ops_per_token,
    plan,
)
from colibri.plan import main as plan_main

L, E, K = 16, 64, 8
EXPERT = 6 * MiB  # one expert record (multiples of 4096: the store rounds buffers up to pages)
DENSE = 20 * MiB  # attention + norms + router per layer
EMBED, HEAD, NORM = 200 * MiB, 100 * MiB, 8192
GLOBAL = EMBED + HEAD + NORM
KV_TOK = 128 * 1024


def synthetic_container(n_layers=L, n_experts=E, top_k=K, expert=EXPERT, dense=DENSE) -> SimpleNamespace:
    """The header fields the planner reads (sizes, names, record membership), on a Container stand-in.

    bf16 everywhere, computed in bf16: no module allocates extra bytes, so sizes are the nbytes.
    """
    bf16 = lambda n, shape=(1,): {"nbytes": n, "shape": list(shape), "dtype": "bf16"}  # noqa: E731
    t = {"model.embed_tokens.weight": bf16(EMBED, (EMBED // 4096, 2048)), "lm_head.weight": bf16(HEAD),
         "model.norm.weight": bf16(NORM)}
    records = {}
    for i in range(n_layers):
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = bf16(dense)
        for e in range(n_experts):
            rec = f"model.layers.{i}.mlp.experts.{e}"
            t[rec + ".gate_up.weight"] = {**bf16(expert), "record": rec}
            members = {"gate_up.weight": rec + ".gate_up.weight"}
            records[rec] = {"nbytes": expert, "offset": 0, "tensors": members}
    cfg = {"num_experts_per_tok": top_k}
    header = {"meta": {"model_type": "synthetic", "quant": {"scheme": "bf16"}, "config": cfg},
              "tensors": t, "records": records}
    return SimpleNamespace(header=header, config=cfg, quant={"scheme": "bf16"}, model_type="synthetic")


def machine(avail=20 * GiB, vram=None, disk=2e9) -> Machine:
    return Machine(avail, avail, vram, disk, 18e9)


@pytest.fixture
def sizes() -> PlanSizes:
    return PlanSizes.from_container(synthetic_container(), kv_per_token=KV_TOK)


def test_sizes_from_header(sizes):
    assert sizes.n_layers == L and sizes.top_k == K
    assert sizes.n_experts == [E] * L and sizes.expert_bytes == [EXPERT] * L == sizes.record_bytes
    assert sizes.layer_dense_bytes == [DENSE] * L and sizes.global_dense_bytes == GLOBAL
    assert sizes.dense_bytes == GLOBAL + L * DENSE
    assert sizes.total_bytes == sizes.dense_bytes + L * E * EXPERT
    assert sizes.global_active == HEAD + NORM + EMBED // (EMBED // 4096)  # one embedding row, all of lm_head


def test_budget_below_experts_gives_disk_tier_and_slots_that_fit(sizes):
    budget = 3 * GiB  # RAM for weights, as colibri run --mem-budget reads it
    r = plan(sizes, machine(), mem_budget=budget)
    n_slots = (budget - sizes.dense_bytes) // EXPERT
    assert [lp.tier for lp in r.layers] == ["disk"] * L
    # One cache shared fairly: every layer gets n_slots // L slots, the first n_slots % L one more.
    got = [lp.slots for lp in r.layers]
    assert got == [n_slots // L + (i < n_slots % L) for i in range(L)]
    assert r.cache_bytes == sum(got) * EXPERT == n_slots * EXPERT
    used = r.resident + r.cache_bytes
    assert r.resident == sizes.dense_bytes and used <= budget < used + EXPERT  # no room for one more expert
    expect_disk = sum(K * (1 - s / E) * EXPERT for s in got)  # uniform routing: hit = slots / E
    assert [lp.hit for lp in r.layers] == [s / E for s in got]
    assert r.disk_per_token == pytest.approx(expect_disk)
    assert r.ram_per_token == pytest.approx(L * (DENSE + K * EXPERT) + sizes.global_active)
    assert r.tok_s == pytest.approx(1 / (expect_disk / 2e9 + r.ram_per_token / 18e9))
    p = r.placement()
    assert p.tiers == ["disk"] * L and p.mem_budget == budget and p.pinned == {}


def test_everything_fits_is_all_ram_and_unbudgeted(sizes):
    r = plan(sizes, machine(avail=40 * GiB))
    assert r.count("ram") == L and r.disk_per_token == 0 and r.cache_bytes == 0
    assert r.weights_budget == 40 * GiB - OUR_RAM_HEADROOM - KV_TOK * DEFAULT_CTX - RUNTIME_BYTES
    assert r.placement().mem_budget is None  # no bound: the store keeps its zero-copy mapping
    # A budget below MemAvailable but above the model: still all RAM, now bounded.
    assert plan(sizes, machine(), mem_budget=7 * GiB).placement().mem_budget == 7 * GiB


def test_model_larger_than_memavailable_goes_to_disk(sizes):
    avail = 4 * GiB
    r = plan(sizes, machine(avail=avail))
    weights = avail - OUR_RAM_HEADROOM - KV_TOK * DEFAULT_CTX - RUNTIME_BYTES
    assert r.count("disk") == L and r.weights_budget == weights
    assert r.placement().mem_budget == weights
    assert r.cache_bytes == (weights - sizes.dense_bytes) // EXPERT * EXPERT


def test_slots_count_their_kv_caches(sizes):
    one = plan(sizes, machine(avail=8 * GiB), ctx=4096)
    four = plan(sizes, machine(avail=8 * GiB), ctx=4096, slots=4)
    assert four.kv_bytes == 4 * one.kv_bytes == 4 * KV_TOK * 4096
    assert one.weights_budget - four.weights_budget == 3 * KV_TOK * 4096
    # A given --mem-budget bounds weights only: the slots do not change it.
    assert plan(sizes, machine(), mem_budget=3 * GiB, slots=8).weights_budget == 3 * GiB


def test_speed_estimate_counts_bytes_and_per_op_cost(sizes):
    m = machine()
    m.op_s = 5e-6
    r = plan(sizes, m, mem_budget=3 * GiB)
    d, ram, ops = r.seconds_per_token
    assert r.ops_per_token == ops_per_token(sizes) > L * K  # every layer runs top_k experts' ops at least
    assert ops > 0 and r.tok_s == pytest.approx(1 / (d + ram + ops))
    assert plan(sizes, machine(), mem_budget=3 * GiB).tok_s > r.tok_s  # op cost unmeasured: left out


def test_a_one_call_model_costs_its_bytes_and_a_per_layer_step(sizes):
    """int8/int4 models whose layers the one-call decode step runs: no per-op cost, the weight stream at
    that scheme's share of the matvec speed, a fixed cost per layer; disk layers too (the call runs them while
    their experts are cached), their reads on top; GPU layers the per-op model."""
    import dataclasses

    from colibri.plan import ONE_CALL_BW_SHARE, ONE_CALL_LAYER_S

    m = machine()
    m.op_s = 5e-6
    one = dataclasses.replace(sizes, one_call=True, scheme="int4")
    r = plan(one, m)
    d, ram, over = r.seconds_per_token
    assert r.one_call == ONE_CALL_BW_SHARE["int4"] and d == 0
    assert ram == pytest.approx(r.ram_per_token / (ONE_CALL_BW_SHARE["int4"] * m.ram_bps))
    assert over == pytest.approx(ONE_CALL_LAYER_S * L) and r.tok_s == pytest.approx(1 / (ram + over))
    streamed = plan(one, m, mem_budget=3 * GiB)  # experts from disk: the same call, plus the reads
    d, ram, over = streamed.seconds_per_token
    assert streamed.count("disk") and streamed.one_call == ONE_CALL_BW_SHARE["int4"] and d > 0
    assert over == pytest.approx(ONE_CALL_LAYER_S * L) and streamed.tok_s == pytest.approx(1 / (d + ram + over))
    m.vram_free = 80 * GiB  # GPU layers: the per-layer path, per-op cost
    gpu = plan(one, m, gpu_budget=40 * GiB)
    assert gpu.count("gpu") and not gpu.one_call and gpu.seconds_per_token[2] == pytest.approx(
        gpu.ops_per_token * m.op_s * PY_PER_OP)
    assert not plan(dataclasses.replace(one, scheme="bf16"), m).one_call  # (no native kernels for bf16)


def test_one_call_shape_read_from_real_containers(ckpt):
    """olmoe, minimax_m2, qwen2_moe (a gated shared expert, a dense layer), deepseek_v2 (MLA, group-limited
    routing), glm4_moe (two router groups) and llama4_text at int4 have the one-call shape; f32 does not."""
    def one_call(model_type: str, scheme: str) -> bool:
        with Container(ckpt.coli(model_type, scheme)) as c:
            return PlanSizes.from_container(c).one_call

    assert all(one_call(t, "int4") for t in ("olmoe", "minimax_m2", "qwen2_moe", "deepseek_v2", "glm4_moe",
                                             "llama4_text"))
    assert not one_call("olmoe", "f32")


def test_gpu_layers_fit_vram_minus_headroom(sizes):
    layer = DENSE + E * EXPERT
    r = plan(sizes, machine(vram=3 * layer + GiB + layer // 2))  # 3.5 layers after the 1 GiB headroom
    assert [lp.tier for lp in r.layers[:4]] == ["gpu"] * 3 + ["ram"] and r.gpu_bytes == 3 * layer
    assert r.ram_per_token == pytest.approx((L - 3) * (DENSE + K * EXPERT) + sizes.global_active)
    assert r.placement().gpu_budget == 3 * layer + layer // 2
    # Without CUDA, a --gpu-budget must not produce GPU layers the Engine would refuse.
    assert plan(sizes, machine(), gpu_budget=10 * GiB).count("gpu") == 0


def _skewed_usage(n_layers=L, n_experts=E, k=K, tokens=1000) -> Usage:
    """Expert e of every layer routed with weight ~ (e+1)^-0.5: low ids are hot."""
    u = Usage([n_experts] * n_layers)
    w = [(e + 1) ** -0.5 for e in range(n_experts)]
    for i in range(n_layers):
        u.counts[i] = [round(tokens * k * x / sum(w)) for x in w]
        u.tokens[i] = tokens
    return u


def test_usage_pins_hottest_first_and_beats_uniform(sizes):
    u = _skewed_usage()
    budget = 3 * GiB
    uni = plan(sizes, machine(), mem_budget=budget)
    hot = plan(sizes, machine(), mem_budget=budget, usage=u)
    assert hot.cache_bytes == uni.cache_bytes  # same bytes, better spent
    above = [e for e in range(E) if u.prob(0, e) > K / E]  # routed more often than average
    n_slots = uni.cache_bytes // EXPERT
    for lp in hot.layers:
        assert lp.pinned == list(range(len(lp.pinned)))  # hottest (lowest id) first, in order
        assert len(lp.pinned) <= lp.slots
    assert sum(len(lp.pinned) for lp in hot.layers) == min(L * len(above), int(n_slots * PIN_SHARE))
    assert hot.layers[0].hit > uni.layers[0].hit
    assert hot.disk_per_token < uni.disk_per_token
    assert hot.placement().pinned[0] == hot.layers[0].pinned
    # Uniform counts: nothing is above average, nothing is pinned.
    flat = Usage([E] * L)
    for i in range(L):
        flat.counts[i], flat.tokens[i] = [K * 10] * E, E * 10
    assert plan(sizes, machine(), mem_budget=budget, usage=flat).placement().pinned == {}


def test_usage_file_round_trip_merge_and_refusal(tmp_path):
    path = tmp_path / "usage.json"
    a = Usage([0, 4, 4], path)
    a.counts[1], a.tokens[1] = [5, 0, 2, 1], 4
    a.counts[2], a.tokens[2] = [1, 1, 1, 5], 4
    a.save()
    b = Usage([0, 4, 4])
    b.counts[1], b.tokens[1] = [1, 3, 0, 0], 2
    total = b.save(path)
    assert total.counts[1] == [6, 3, 2, 1] and total.tokens[1] == 6
    back = Usage.load(path, [0, 4, 4])
    assert back.counts == total.counts and back.tokens == total.tokens
    assert back.hottest(1) == [0, 1, 2, 3] and back.hottest(2, 2) == [3, 0]  # ties: lower id first
    assert back.hit_rate(1, [0, 1]) == pytest.approx(9 / 12)
    assert back.prob(1, 0) == pytest.approx(1.0)
    assert back.pinned({1: 2, 2: 1}) == {1: [0, 1], 2: [3]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usage.json", "usage.json.lock"]  # no temp left
    assert json.loads(path.read_text())["format"] == "colibri-usage"
    with pytest.raises(ColibriError, match="another model"):
        Usage.load(path, [0, 8, 8])
    path.write_text("{not json")
    with pytest.raises(ColibriError, match="cannot read usage file"):
        Usage.load(path, [0, 4, 4])


def test_recorder_counts_every_routed_token(ckpt, tmp_path):
    llm = colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=2)
    rec = Recorder(llm)
    prompt, n = [1, 17, 42, 99, 7], 6
    list(llm.generate_ids(prompt, n, temperature=0, ignore_eos=True))
    u = rec.usage()
    rec.detach()
    forwards = len(prompt) + n  # (the engine feeds the last token too where a listener watches the routes)
    k = llm.args.num_experts_per_tok
    for i in range(llm.n_layers):
        assert u.tokens[i] == forwards and sum(u.counts[i]) == k * forwards
    assert rec not in llm._runner.listeners  # detached: the engine's native runs come back
    path = tmp_path / "u.json"
    u.save(path)
    u = Usage.load(path, u.experts)
    # Pinning order from real counts: the planner pins a layer's experts hottest first.
    with Container(llm.container.path) as c:
        sizes = PlanSizes.from_container(c)
        p = auto_placement(c, mem_budget=sizes.dense_bytes + 5 * max(sizes.expert_bytes), usage=u,
                           machine=machine(), ctx=64)
    assert p.tiers == ["disk"] * sizes.n_layers and p.pinned
    for i, ids in p.pinned.items():
        assert ids == u.hottest(i)[: len(ids)]
    llm.close()
    # And the Engine runs that placement: greedy output equals the all-RAM run.
    plain = colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=2)
    ref = list(plain.generate_ids(prompt, n, temperature=0))
    plain.close()
    llm = colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=64, threads=2, placement=p)
    assert list(llm.generate_ids(prompt, n, temperature=0)) == ref
    assert llm.store_stats()["cache_pinned"] == sum(len(v) for v in p.pinned.values())
    llm.close()


def test_auto_placement_and_plan_cli_on_real_container(ckpt, capsys):
    path = ckpt.coli("olmoe", "int8")
    with Container(path) as c:
        sizes = PlanSizes.from_container(c)
        assert sizes.kv_per_token > 0 and sizes.n_experts == [8] * sizes.n_layers
        assert auto_placement(c, mem_budget=8 * GiB).tiers == ["ram"] * sizes.n_layers
        budget = sizes.dense_bytes + 10 * max(sizes.expert_bytes)
        p = auto_placement(c, mem_budget=budget)
    assert p.tiers == ["disk"] * sizes.n_layers and p.mem_budget == budget
    assert plan_main(["--model", str(path), "--mem-budget", str(budget), "--disk-speed", "1G"]) == 0
    out = capsys.readouterr().out
    assert "placement: 0 layers on the GPU, 0 in RAM, 3 with experts read from disk" in out
    assert "3..4 slots per disk layer" in out and "10 slots" not in out  # 10 slots shared fairly by 3 layers
    assert "seed" not in out and "expected decode speed: about" in out
    assert plan_main(["--model", str(path), "--slots", "4", "--ctx-size", "100", "--disk-speed", "1G"]) == 0
    out = capsys.readouterr().out
    assert f"KV cache: {sizes.kv_per_token * 400 / MiB:.1f} MiB = 4 slots x 100 positions" in out


def test_plan_cli_refuses_bad_numbers(ckpt, capsys):
    from colibri.cli import main

    path = str(ckpt.coli("olmoe", "int8"))
    for bad in (["--ctx-size", "-5"], ["--slots", "0"], ["--mem-budget", "nan"], ["--mem-budget", "1e400"],
                ["--disk-speed", "0"], ["--probe-seconds", "nan"]):
        assert main(["plan", "--model", path, *bad]) != 0, bad
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error" in err, bad


def test_probes_measure_something(ckpt):
    bps, note = measure_disk(str(ckpt.coli("olmoe", "int8")), seconds=0.05, chunk=64 * 1024)
    assert bps > 1e6 and math.isfinite(bps) and "random reads" in note
    assert 0 < measure_op() < 1e-2
    for scheme in ("f32", "int8"):
        v = measure_matvec(scheme, seconds=0.01, weight_mib=4)
        assert math.isfinite(v) and v > 0


def test_run_usage_file_accumulates_across_runs(ckpt, tmp_path, capsys):
    from colibri.cli import main

    path, usage = ckpt.coli("olmoe", "f32"), tmp_path / "hot.json"
    args = ["--model", str(path), "-p", "The capital of France", "-n", "5", "--temp", "0", "--ignore-eos",
            "--ctx-size", "64", "--usage-file", str(usage), "--no-stats"]
    assert main(args) == 0
    first_out = capsys.readouterr().out
    one = json.loads(usage.read_text())
    assert main(args) == 0
    assert capsys.readouterr().out == first_out  # pinning or not, greedy output is the same
    two = json.loads(usage.read_text())
    for layer, t in one["tokens"].items():
        assert t > 0 and two["tokens"][layer] == 2 * t
        assert two["counts"][layer] == [2 * c for c in one["counts"][layer]]
    assert main(["plan", "--model", str(path), "--usage-file", str(usage), "--disk-speed", "1G"]) == 0
    assert "learned hot set" in capsys.readouterr().out


def test_load_takes_budgets_as_sizes_and_refuses_bad_ones(ckpt):
    """`colibri.load(..., mem_budget="2M")` is the CLI's `--mem-budget 2M` (it was a TypeError deep in the
    planner); a budget that is neither bytes nor a size is refused by name."""
    path = ckpt.coli("olmoe", "int8")
    with colibri.load(path, ctx_size=32, mem_budget="2M") as llm:
        assert llm.store.mem_budget == 2 * MiB
    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(ColibriError, match="mem_budget|bad size"):
            colibri.load(path, ctx_size=32, mem_budget=bad)
    with pytest.raises(ColibriError, match="gpu_budget"):
        colibri.load(path, ctx_size=32, gpu_budget=[1])
