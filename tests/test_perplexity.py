"""`colibri perplexity`: exact against transformers, KL against a reference, streamed == in RAM, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_tiny import TRAIN_TEXT, hf_logits, load_hf
from transformers import AutoTokenizer

from colibri.analysis.perplexity import perplexity
from colibri.cli import main
from colibri.convert.converter import convert
from colibri.demo import DEMO_HF
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.store import Placement, model_sizes

CTX = 64


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def hf_reference(folder, text: str, ctx: int, stride: int) -> tuple[float, int, int]:
    """(perplexity, scored tokens, windows) computed independently with transformers: the same windows
    (BOS in place of each window's first token), scoring each window's last min(stride, ctx // 2) tokens."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = load_hf(folder)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n_score = min(stride, ctx // 2)
    nll, n, windows = 0.0, 0, 0
    for start in range(0, len(ids) - ctx + 1, stride):
        w = [tok.bos_token_id, *ids[start + 1 : start + ctx]]
        lp = torch.log_softmax(hf_logits(model, w).double(), -1)  # [ctx, V]
        for pos in range(ctx - n_score, ctx):  # token `pos`, predicted by the logits at pos - 1
            nll -= lp[pos - 1, w[pos]].item()
            n += 1
        windows += 1
    return math.exp(nll / n), n, windows


@pytest.mark.parametrize("stride", [None, 24])
def test_perplexity_matches_transformers(ckpt, stride):
    folder, model = ckpt.hf("mixtral"), ckpt.coli("mixtral", "f32")
    ref, n, windows = hf_reference(folder, TRAIN_TEXT, CTX, stride or CTX)
    r = perplexity(model, TRAIN_TEXT, CTX, stride, threads=1, slots=3, progress=False)  # 3 windows per step
    assert (r.tokens_scored, r.windows) == (n, windows) and windows >= 4
    assert abs(r.ppl / ref - 1) < 1e-3, (r.ppl, ref)
    assert r.ppl > 10  # a random-init model: far from the trivial 1.0 a scoring bug could give


def test_kl_of_a_model_against_itself_is_zero(ckpt):
    model = ckpt.coli("mixtral", "f32")
    r = perplexity(model, TRAIN_TEXT, CTX, kl_base=model, threads=1, progress=False)  # two engines, one file
    assert r.kl.mean_kl == pytest.approx(0, abs=1e-9) and r.kl.max_kl == pytest.approx(0, abs=1e-9)
    assert r.kl.top1_agreement == 1.0 and r.kl.ppl_ratio == pytest.approx(1, abs=1e-12)


def test_int4_against_bf16_has_positive_kl(ckpt):
    bf16, int4 = ckpt.coli("mixtral", "bf16"), ckpt.coli("mixtral", "int4")
    r = perplexity(int4, TRAIN_TEXT, CTX, kl_base=bf16, threads=1, progress=False)
    alone = perplexity(bf16, TRAIN_TEXT, CTX, threads=1, progress=False)
    assert r.kl.mean_kl > 1e-4 and r.kl.max_kl >= r.kl.p99_kl >= 0
    assert 0 < r.kl.top1_agreement <= 1
    assert r.kl.ppl_base == pytest.approx(alone.ppl, rel=1e-9)
    assert r.kl.ppl_ratio == pytest.approx(r.ppl / alone.ppl, rel=1e-9)


def test_streamed_from_disk_equals_ram(ckpt):
    bf16, int4 = ckpt.coli("mixtral", "bf16"), ckpt.coli("mixtral", "int4")
    with Container(int4) as c:
        s = model_sizes(c)
    one_slot = s.dense_bytes + len(s.moe_layers) * max(s.expert_bytes[i] for i in s.moe_layers)
    ram = perplexity(int4, TRAIN_TEXT, CTX, kl_base=bf16, threads=1, progress=False)
    disk = perplexity(int4, TRAIN_TEXT, CTX, kl_base=bf16, threads=1, progress=False,
                      placement=Placement(["disk"] * s.n_layers), mem_budget=one_slot)
    assert (disk.ppl, disk.kl.mean_kl, disk.kl.top1_agreement) == (ram.ppl, ram.kl.mean_kl, ram.kl.top1_agreement)


def test_text_shorter_than_a_window_is_an_error(ckpt):
    with pytest.raises(ColibriError, match="fewer than one window"):
        perplexity(ckpt.coli("mixtral", "f32"), "Once upon a time", CTX, threads=1, progress=False)


def test_cli_json(ckpt, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TRAIN_TEXT, encoding="utf-8")
    int4, bf16 = str(ckpt.coli("mixtral", "int4")), str(ckpt.coli("mixtral", "bf16"))
    rc, out, _ = run(["perplexity", "-m", int4, "-f", str(text), "--ctx-size", str(CTX), "--threads", "1",
                      "--kl-base", bf16, "--json", "--no-progress"], capsys)
    assert rc == 0
    r = json.loads(out)
    direct = perplexity(int4, TRAIN_TEXT, CTX, kl_base=bf16, threads=1, progress=False)
    assert r["ppl"] == pytest.approx(direct.ppl, rel=1e-9) and r["ctx_size"] == CTX and r["stride"] == CTX
    assert r["kl"]["mean_kl"] == pytest.approx(direct.kl.mean_kl, rel=1e-6)
    assert set(r["kl"]) == {"mean_kl", "max_kl", "p99_kl", "top1_agreement", "ppl_base", "ppl_ratio"}
    rc, out, _ = run(["perplexity", "-m", bf16, "-f", str(text), "--ctx-size", str(CTX), "--threads", "1"], capsys)
    assert rc == 0 and out.startswith("perplexity: ") and "KL" not in out


@pytest.mark.parametrize("case, message", [
    ("missing-text", "cannot read"),
    ("missing-model", "not found"),
    ("missing-base", "not found"),
    ("short-text", "fewer than one window"),
    ("other-tokenizer", "different tokenizers"),  # the demo model as the reference of a test model
])
def test_cli_errors_are_one_line(ckpt, tmp_path, capsys, case, message):
    model = str(ckpt.coli("mixtral", "f32"))
    capsys.readouterr()  # building the checkpoint on first use may have drawn a progress bar
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time" if case == "short-text" else TRAIN_TEXT, encoding="utf-8")
    argv = ["perplexity", "-m", model, "-f", str(text), "--ctx-size", str(CTX), "--threads", "1"]
    if case == "missing-text":
        argv[4] = str(tmp_path / "nope.txt")
    elif case == "missing-model":
        argv[2] = str(tmp_path / "nope.coli")
    elif case == "missing-base":
        argv += ["--kl-base", str(tmp_path / "nope.coli")]
    elif case == "other-tokenizer":
        argv += ["--kl-base", str(convert(DEMO_HF, tmp_path / "demo.coli", "bf16", progress=False))]
        capsys.readouterr()
    rc, out, err = run(argv, capsys)
    assert rc == 1 and out == ""
    assert err.startswith("colibri: error:") and message in err and err.count("\n") == 1, err
