"""colibri on a Ray cluster (colibri/cluster): pipeline stages give the single-node engine's bits (prompt logits,
greedy tokens, seeded samples, staggered batches, reused slots), for plain, MLA, sliding-window-with-sinks and
recurrent-hybrid families; faults end in one line naming the node, and a stage killed mid-generation fails the
requests in flight, leaves the engine up (health: degraded) and the next request runs.

The tests start their own local cluster (3 nodes on this machine, `ray start` with the resource `colibri`, a free
port outside Ray's worker range) and stop it."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import colibri
from colibri.errors import ColibriError

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'colibri[cluster]')")

RAY = str(Path(sys.executable).parent / "ray")
PROMPTS = [[1, 17, 42, 99, 7, 150, 23, 64, 5, 200], [3, 9, 27, 81, 243, 11, 33], [250, 4, 8, 15, 16, 23, 42, 108]]
N = 10


def _free_port() -> int:
    """A free TCP port above Ray's worker ports (10002-19999)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 20000:
            return port


def _ray(*args: str, env: dict | None = None) -> None:
    subprocess.run([RAY, *args], check=True, capture_output=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def cluster() -> str:
    """Three local Ray nodes of one CPU each, offering `colibri`; yields the head's address."""
    if not Path(RAY).exists() or shutil.which("ray", path=str(Path(RAY).parent)) is None:
        pytest.skip("the `ray` command is not installed")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # Ray's own default, said aloud: a token file left in ~/.ray by an earlier `ray.init()` otherwise makes the head
    # ask the other nodes for a token they do not send
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", CUDA_VISIBLE_DEVICES="")
    node = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--resources", '{"colibri": 1}']
    try:
        _ray("start", "--head", "--port", str(port), "--include-dashboard", "false", *node, env=env)
        for _ in range(2):
            _ray("start", "--address", address, *node, env=env)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _ray("stop", "--force", env=env)
        if saved is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _generate(llm, prompt: list[int], **kw) -> list[int]:
    return list(llm.generate_ids(prompt, N, ignore_eos=True, **kw))


def _reference(path: Path) -> dict:
    """The single-node engine's outputs for the checks below."""
    with colibri.load(path, ctx_size=64, threads=1, slots=2) as llm:
        return {"logits": llm.logits(PROMPTS[0]), "greedy": [_generate(llm, p, temperature=0) for p in PROMPTS],
                "sampled": _generate(llm, PROMPTS[1], temperature=0.9, seed=7)}


def _staggered(llm) -> list[list[int]]:
    """Request 0 starts; request 1 joins after 3 of its tokens; request 2 takes the slot request 0 frees."""
    a = llm.submit(PROMPTS[0], N, temperature=0, ignore_eos=True)
    while a.stats.generated < 3 and not a.done:
        time.sleep(0.002)
    b = llm.submit(PROMPTS[1], N, temperature=0, ignore_eos=True)
    got_a = a.wait()
    c = llm.submit(PROMPTS[2], N, temperature=0, ignore_eos=True)
    return [got_a, b.wait(), c.wait()]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_stages_and_expert_workers_give_the_single_node_bits(ckpt, cluster, model_type) -> None:
    """f32: 3 stages (and 2, for two families), and 3 expert workers: prompt logits bit for bit, greedy tokens, a
    seeded sample, staggered joins and a reused slot, each equal to the single-node engine's."""
    path = ckpt.coli(model_type, "f32")
    ref = _reference(path)
    two = [("pipeline", 2)] if model_type in ("mixtral", "qwen3_next") else []  # (3 stages cut every family)
    for mode, n in (*two, ("pipeline", 3), ("experts", 3)):
        with colibri.load(path, ctx_size=64, threads=1, slots=2, cluster=cluster, cluster_mode=mode,
                          cluster_stages=n) as llm:
            if mode == "pipeline":
                assert len(llm.plan.stages) == n and llm.kv_bytes() > 0  # (the K/V the stages hold)
                assert llm.plan.stages[0].lo == 0 and llm.plan.stages[-1].hi == llm.n_layers
            else:  # every expert on exactly one worker
                shares = llm.metrics()["cluster"]["nodes"]
                assert len(shares) == n
            assert torch.equal(llm.logits(PROMPTS[0]), ref["logits"])
            assert [_generate(llm, p, temperature=0) for p in PROMPTS] == ref["greedy"]
            assert _generate(llm, PROMPTS[1], temperature=0.9, seed=7) == ref["sampled"]
            assert _staggered(llm) == ref["greedy"]
            m = llm.metrics()
            assert llm.health()["cluster"] == "ok" and m["steps"] > 0


def _routed(llm, want: list[list[int]]) -> dict:
    """The three prompts at once (their tokens checked against `want`) -> the routes the step listeners saw, by
    (prompt index, position): {layer: (ids [k], weights [k])}."""
    seen: dict = {}
    llm.add_step_listener(lambda info: seen.update(
        {(rid, pos): {layer: (i[r], w[r]) for layer, (i, w) in info.routes.items()}
         for r, (rid, pos, _) in enumerate(info.rows)}))
    hs = [llm.submit(p, N, temperature=0, ignore_eos=True) for p in PROMPTS]
    assert [h.wait() for h in hs] == want
    index = {h.id: i for i, h in enumerate(hs)}
    return {(index[rid], pos): r for (rid, pos), r in seen.items()}


def _same_routes(a: dict, b: dict) -> bool:
    """Same experts, weights equal to f32 rounding (a batch's row count may change a matmul's last bit)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and torch.allclose(a[k][1], b[k][1], rtol=1e-5, atol=1e-6) for k in a)


def test_micro_batches_pipeline_a_step_without_changing_it(ckpt, cluster) -> None:
    """Three sequences in a step over 3 stages run as 3 micro-batches (the stages overlap them); the tokens are
    those of each request alone, with micro-batching on and off, and every step's routes (gathered from the stages
    as two stacked arrays) are the single node's."""
    path = ckpt.coli("olmoe", "f32")
    ref = _reference(path)["greedy"]
    with colibri.load(path, ctx_size=64, threads=1, slots=3) as llm:
        single = _routed(llm, ref)
    with colibri.load(path, ctx_size=64, threads=1, slots=3, cluster=cluster, cluster_stages=3) as llm:
        staged = _routed(llm, ref)
        assert single.keys() == staged.keys() and len(single[0, 0]) == llm.n_layers
        assert all(_same_routes(single[k], staged[k]) for k in single)
        assert llm.plan.micro_batches > llm.plan.steps  # some steps were cut
        llm.plan.micro = False
        hs = [llm.submit(p, N, temperature=0, ignore_eos=True) for p in PROMPTS]
        assert [h.wait() for h in hs] == ref


def test_routes_cross_stacked_with_their_values() -> None:
    """What a stage passes on: the routes of the stages before it and its own, as two stacked arrays (ids int64,
    weights f32: bf16 weights widen exactly), read back as the plan's routes are."""
    from colibri.cluster import wire
    from colibri.engine.stats import StackedRoutes

    first = {0: (torch.tensor([[3, 1]]), torch.tensor([[0.75, 0.25]])),
             2: (torch.tensor([[5, 6]], dtype=torch.int32), torch.randn(1, 2).bfloat16())}
    second = StackedRoutes([7], torch.tensor([[[1, 2]]]), torch.rand(1, 1, 2))
    packed = wire.pack_routes(second, wire.pack_routes(first))
    assert packed[0] == (0, 2, 7) and packed[1].shape == packed[2].shape == (3, 1, 2)
    got = wire.unpack_routes(packed)
    assert list(got) == [0, 2, 7]
    for layer, (ids, w) in {**first, 7: second[7]}.items():
        assert torch.equal(got[layer][0], ids.long()) and torch.equal(got[layer][1], w.float())
    assert wire.pack_routes({}) is None and wire.unpack_routes(wire.pack_routes({}, None)) == {}


def test_int8_stages_and_workers_run_the_native_kernels(ckpt, cluster) -> None:
    """bf16 compute (int8 weights): each stage's range runs in the native kernels, expert workers run the native
    expert kernel and the head sums their slots with it; the tokens and prompt logits equal the single node's."""
    path = ckpt.coli("olmoe", "int8")
    ref = _reference(path)
    with colibri.load(path, ctx_size=64, threads=1, slots=2, cluster=cluster, cluster_stages=2) as llm:
        assert all("native" in s.info["plan"] for s in llm.plan.stages)
        assert [_generate(llm, p, temperature=0) for p in PROMPTS] == ref["greedy"]
    with colibri.load(path, ctx_size=64, threads=1, slots=2, cluster=cluster, cluster_mode="experts") as llm:
        assert [_generate(llm, p, temperature=0) for p in PROMPTS] == ref["greedy"]
        assert torch.equal(llm.logits(PROMPTS[0]), ref["logits"])
        assert llm.metrics()["cluster"]["calls"] > 0


def test_a_killed_stage_fails_the_requests_in_flight_and_comes_back(ckpt, cluster) -> None:
    path = ckpt.coli("olmoe", "f32")
    ref = _reference(path)["greedy"]
    with colibri.load(path, ctx_size=512, threads=1, slots=2, cluster=cluster, cluster_stages=2) as llm:
        h = llm.submit(PROMPTS[0], 400, temperature=0, ignore_eos=True)
        while h.stats.generated < 2:
            time.sleep(0.002)
        ray.kill(llm.plan.stages[1].actor, no_restart=False)  # Ray restarts the actor: an empty process
        with pytest.raises(ColibriError, match=r"stage 1 on .* was lost"):
            h.wait()
        health = llm.health()
        assert health["cluster"] == "degraded" and "stage 1" in health["cluster_error"]
        assert _generate(llm, PROMPTS[0], temperature=0) == ref[0]  # the stage reloads; the slots start empty
        assert llm.health()["cluster"] == "ok"


def test_faults_at_start_are_one_line_naming_the_node(ckpt, cluster, monkeypatch) -> None:
    path = ckpt.coli("olmoe", "f32")
    with pytest.raises(ColibriError, match=r"5 node\(s\) with the resource 'colibri' needed, 3 found"):
        colibri.load(path, ctx_size=64, cluster=cluster, cluster_stages=5)
    with pytest.raises(ColibriError, match=r"cluster: stage \d on .*: --mem-budget .* leaves no room"):
        colibri.load(path, ctx_size=64, cluster=cluster, cluster_stages=2, mem_budget=4096)
    # a node that holds another file at the path it reads
    from colibri.cluster import nodes

    other, start, calls = str(ckpt.coli("olmoe", "int8")), nodes.start_stage, []

    def second_elsewhere(node, p, **kw):  # the second node reads another container
        calls.append(node)
        return start(node, other if len(calls) == 2 else p, **kw)

    monkeypatch.setattr(nodes, "start_stage", second_elsewhere)
    with pytest.raises(ColibriError, match=r"node .* its container .* differs from the head's"):
        colibri.load(path, ctx_size=64, cluster=cluster, cluster_stages=2)
    with pytest.raises(ColibriError, match=r"no Ray cluster at 127.0.0.1:1\b"):
        colibri.load(path, ctx_size=64, cluster="127.0.0.1:1")


def test_a_step_past_its_deadline_is_one_line(ckpt, cluster) -> None:
    path = ckpt.coli("olmoe", "f32")
    with colibri.load(path, ctx_size=64, threads=1, cluster=cluster, cluster_stages=2, cluster_timeout=1e-4) as llm:
        with pytest.raises(ColibriError, match=r"did not answer within"):
            _generate(llm, PROMPTS[0], temperature=0)
        llm.plan.deadline_s = 60.0
        assert len(_generate(llm, PROMPTS[0], temperature=0)) == N


def test_a_lost_expert_worker_fails_its_step_and_is_reloaded(ckpt, cluster) -> None:
    """Expert workers hold no K/V: the step's request ends with the lost worker named, the next one runs."""
    path = ckpt.coli("olmoe", "f32")
    ref = _reference(path)["greedy"]
    with colibri.load(path, ctx_size=512, threads=1, slots=2, cluster=cluster, cluster_mode="experts",
                      cluster_stages=2) as llm:
        source = llm._cluster_part
        h = llm.submit(PROMPTS[0], 400, temperature=0, ignore_eos=True)
        while h.stats.generated < 2:
            time.sleep(0.002)
        ray.kill(source.workers[1], no_restart=False)
        with pytest.raises(ColibriError, match=r"expert worker 1 on .* was lost"):
            h.wait()
        assert llm.health()["cluster"] == "degraded"
        assert _generate(llm, PROMPTS[1], temperature=0) == ref[1]
        assert llm.health()["cluster"] == "ok"


def test_the_cli_runs_on_the_cluster_and_plans_the_split(ckpt, cluster, capsys) -> None:
    from colibri.cli import main

    path = str(ckpt.coli("olmoe", "f32"))
    assert main(["plan", "--model", path, "--cluster", cluster, "--cluster-stages", "3", "--disk-speed", "1G"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 3 stage(s)" in out and out.count("  stage ") == 3 and "expected decode" in out, out
    hop = re.search(r"\+ 3 process crossing\(s\) x ([0-9.]+) ms \(half a Ray round trip", out)
    assert hop and 0 < float(hop[1]) < 1000, out  # (timed on this cluster: 2 remote stages, 3 crossings)
    assert "layers 0-0" in out and "(this process)" in out
    for mode in ("pipeline", "experts"):
        assert main(["run", "--model", path, "--prompt", "Once upon", "-n", "4", "--temperature", "0", "--ctx-size",
                     "64", "--cluster", cluster, "--cluster-mode", mode, "--log-level", "info", "--stats"]) == 0
        err = capsys.readouterr().err
        assert ("cluster of 3 stages" in err) if mode == "pipeline" else ("asked for torch" in err), err
        assert "[colibri] cluster: 3 " + ("stages (layers 0-0 on" if mode == "pipeline" else "expert workers") in err
    assert main(["run", "--model", path, "--prompt", "x", "--cluster", cluster, "--ram-layers", "2"]) == 1
    assert "--ram-layers does not apply with --cluster" in capsys.readouterr().err


def test_replicas_serve_one_endpoint_through_ray_serve(ckpt, cluster) -> None:
    """`colibri serve --replicas 2 --cluster ADDR`: two whole engines behind one OpenAI endpoint; answers equal the
    single engine's; /health and /metrics cover both; SIGTERM takes them down."""
    import json
    import signal
    import tempfile
    import urllib.request

    path = ckpt.coli("olmoe", "f32")
    with colibri.load(path, ctx_size=64, threads=1) as llm:
        texts = [llm.tokenizer.decode(_generate(llm, p, temperature=0)) for p in PROMPTS]
    port = _free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "colibri", "serve", "--model", str(path), "--port", str(port),
                             "--threads", "1", "--ctx-size", "64", "--slots", "2", "--replicas", "2", "--cluster",
                             cluster], stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ,
                                                                                   RAY_USAGE_STATS_ENABLED="0"))

    def get(route: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{route}", timeout=30) as r:
            return r.read().decode()

    def post(body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    try:
        deadline, health = time.monotonic() + 180, {}
        while time.monotonic() < deadline and health.get("replicas") != 2:
            assert proc.poll() is None, log.seek(0) or log.read()
            try:
                health = json.loads(get("/health"))
            except OSError:
                pass
            time.sleep(0.5)
        assert health.get("replicas") == 2 and health["status"] == "ok" and health["slots"] == 4, health
        for p, want in zip(PROMPTS, texts):  # (several: Serve spreads them over both replicas)
            got = post({"prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True})
            assert got["choices"][0]["text"] == want
        metrics = get("/metrics")
        assert metrics.count('colibri_generation_tokens_total{replica="') == 2, metrics
        while "serving 2 replica(s)" not in (log.seek(0) or log.read()) and time.monotonic() < deadline:
            time.sleep(0.2)  # (the endpoint answers before `serve.run` returns)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.seek(0)
    out = log.read()
    assert "serving 2 replica(s)" in out and proc.returncode == 0, out[-3000:]
