"""`colibri bench`: the JSON it prints is complete, sane, and its outputs are the real greedy tokens."""

from __future__ import annotations

import json

import pytest

import colibri
from colibri.analysis.bench import PROMPTS
from colibri.cli import main


@pytest.fixture(scope="module")
def bench_json(ckpt):
    path = ckpt.coli("olmoe", "int8")
    return path


def test_bench_json_keys_and_values(bench_json, capsys):
    n, k = 5, 2
    assert main(["bench", "--model", str(bench_json), "-n", str(n), "--prompts", str(k), "--json",
                 "--threads", "2", "--ctx-size", "256"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "peak_rss_mib", "cache_hit_rate", "load_s",
                "bytes_read_per_token", "prefetch_precision", "prompt_tokens", "generated", "outputs"):
        assert key in r, key
    llm = colibri.load(bench_json, ctx_size=256, threads=2)
    lens = [len(llm.tokenizer.encode(p)) for p in PROMPTS[:k]]
    assert r["prompts"] == k and r["n_tokens"] == n and r["scheme"] == "int8"
    assert r["prompt_tokens"] == sum(lens) and r["generated"] == k * n
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and 0 < r["ttft_ms"] < 60_000
    assert 50 < r["peak_rss_mib"] < 8192
    # The reported outputs are the model's own greedy continuations, EOS ignored, n tokens each.
    for text, toks in zip(PROMPTS[:k], r["outputs"]):
        assert len(toks) == n
        ref = list(llm.generate_ids(llm.tokenizer.encode(text), n, temperature=0, ignore_eos=True))
        assert toks == ref
    hr = r["cache_hit_rate"]
    assert hr is None or 0.0 <= hr <= 1.0
    llm.close()


def test_bench_text_output_and_bad_args(bench_json, capsys):
    assert main(["bench", "--model", str(bench_json), "-n", "3", "--prompts", "1", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "tok/s" in out and "peak RSS" in out
    assert main(["bench", "--model", str(bench_json), "-n", "1"]) == 1  # -n must be >= 2
    assert "need -n >= 2" in capsys.readouterr().err


def test_bench_under_a_budget_reports_cache_figures(bench_json, capsys):
    from colibri.format.container import Container
    from colibri.store import model_sizes

    with Container(bench_json) as c:
        sizes = model_sizes(c)
    budget = sizes.dense_bytes + 4 * max(sizes.expert_bytes)  # 4 of 3 x 8 experts: reads every token
    base = ["bench", "--model", str(bench_json), "-n", "6", "--prompts", "2", "--json", "--threads", "2"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    assert main(base + ["--mem-budget", str(budget)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["outputs"] == free["outputs"]  # tiers change speed, never tokens
    assert free["cache_hit_rate"] is None and free["decode_bytes_read_per_token"] == 0
    assert 0.0 <= r["cache_hit_rate"] < 1.0 and r["decode_bytes_read_per_token"] > 0
    assert r["store_stats"]["tiers"] == ["disk"] * sizes.n_layers
    assert r["store_stats"]["resident_bytes"] <= budget
