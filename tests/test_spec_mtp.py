"""The model's own MTP layer as a draft source (layers/mtp.py, engine/mtp.py): tiny checkpoints of every family
that runs one, each shipping its MTP layer as the family's release does (tests/mtp_layouts.py: the last layer(s) of
an (L + STEP)-layer transformers model under the release's names). The converter keeps it (and drops it with
--no-mtp); its logits match the layer composed from transformers' own modules; its drafts after every verify equal
what it predicts from the true context (its K/V rolled back right); greedy output with it equals plain decoding's;
the demo's trained layer drafts right."""

from __future__ import annotations

import itertools
import json
import re
import shutil

import pytest
import torch
from hf_tiny import load_hf, make_tiny_checkpoint, tiny_config_kwargs
from mtp_layouts import DENSE, LAYOUT, PER_LAYER, STEP, ZERO_CENTRED, L, big_kwargs, main_config, ship
from safetensors.torch import load_file, save_file

import colibri
from colibri.convert.converter import convert
from colibri.engine import mtp as engine_mtp
from colibri.engine import speculative
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.kernels import native

PROMPT = [1, 88, 5, 61, 230, 12, 9, 88, 5]
N = 20


@pytest.fixture(autouse=True)
def _every_draft_verified(monkeypatch):
    """The gate's depth comes from measured step times (it declines drafts where they cost more than they give, as
    on these tiny models in RAM): here every draft the layer makes is verified, so what runs does not depend on
    timing."""
    monkeypatch.setattr(speculative, "choose", lambda gains, *_: [len(g) for g in gains])


@pytest.fixture(scope="module", params=list(LAYOUT))
def mtp_ckpt(tmp_path_factory, request):
    """(HF folder with an MTP layer as the family ships it, the (L + STEP)-layer transformers model whose last
    layers it is, the MTP layer's own weights by role, its f32 container)."""
    model_type, root = request.param, tmp_path_factory.mktemp("mtp")
    big = make_tiny_checkpoint(model_type, root / "big", **big_kwargs(model_type, tiny_config_kwargs(model_type)))
    ref = load_hf(big)
    hf = root / "hf"
    shutil.copytree(big, hf)
    full = json.loads((hf / "config.json").read_text())
    cfg = full.get("text_config", full)  # (GLM-4.5V's: a multimodal checkpoint's text model)
    main_config(model_type, cfg)
    (hf / "config.json").write_text(json.dumps(full))
    H = cfg["hidden_size"]
    g = torch.Generator().manual_seed(7)
    one = 0.0 if model_type in ZERO_CENTRED else 1.0
    own = {"enorm": one + 0.1 * torch.randn(H, generator=g), "hnorm": one + 0.1 * torch.randn(H, generator=g),
           "eh_proj": 0.05 * torch.randn(H, 2 * H, generator=g), "norm": one + 0.1 * torch.randn(H, generator=g)}
    if LAYOUT[model_type] == "ernie":  # (its layer ends with the model's own final norm)
        own["norm"] = _final_norm(ref).weight.detach().clone()
    st = load_file(hf / "model.safetensors")
    extra = ship(model_type, st, own, ref.lm_head.weight.detach().clone(),
                 ref.get_input_embeddings().weight.detach().clone())
    save_file(st, str(hf / "model.safetensors"), metadata={"format": "pt"})
    save_file(extra, str(hf / "mtp.safetensors"), metadata={"format": "pt"})
    return hf, ref, own, convert(hf, root / "m.coli", "f32", 32, progress=False)


def _reference(ref, own: dict, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions 0..len-2 (row i: from h_i and token i + 1), composed from transformers'
    own modules: the main model's final hidden states, then layer 3 of the 4-layer model over
    eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then the head after the layer's norm (each norm the family's own
    RMSNorm class)."""
    main = load_hf_prefix(ref)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = main(ids[:, :-1])  # [1, T, H]: after the final norm
        e = ref.get_input_embeddings()(ids[:, 1:])

        text, tc = _text(ref), _text_config(ref)

        def rms(x, w):
            n = type(_final_norm(ref))(w.shape[0], eps=_eps(tc))
            n.weight.copy_(w)
            return n(x)

        x = torch.cat([rms(e, own["enorm"]), rms(h, own["hnorm"])], -1) @ own["eh_proj"].T
        T = x.shape[1]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)
        kind = (getattr(tc, "layer_types", None) or [None] * (L + 1))[L]
        if kind == "sliding_attention":  # (transformers' window: a query sees its last `sliding_window` positions)
            mask = mask + torch.full((T, T), float("-inf")).tril(-tc.sliding_window)
        per_type = tc.model_type in ("mimo_v2_flash", "mellum")  # (a RoPE per layer type)
        rotary = None if getattr(text, "rotary_emb", None) is None else \
            text.rotary_emb(x, pos, kind) if per_type else text.rotary_emb(x, pos)  # (Nemotron-H: none)
        layer = text.layers[L]
        if LAYOUT[tc.model_type] == "nemotron":  # (the step's layers in turn)
            y = x
            for i in range(STEP["nemotron_h"]):
                y = text.layers[L + i](y, attention_mask=mask[None, None], position_ids=pos)
                y = y[0] if isinstance(y, tuple) else y
        elif LAYOUT[tc.model_type] == "longcat":  # (its layer's first MLA and MLP, as a plain layer)
            a, _ = layer.self_attn[0](hidden_states=layer.input_layernorm[0](x), attention_mask=mask[None, None],
                                      position_ids=pos, position_embeddings=rotary)
            y = x + a
            y = y + layer.mlps[0](layer.post_attention_layernorm[0](y))
        else:
            y = layer(x, attention_mask=mask[None, None], position_ids=pos, position_embeddings=rotary)
            y = y[0] if isinstance(y, tuple) else y
        return (rms(y, own["norm"]) @ ref.lm_head.weight.T)[0]  # [T, V]


def load_hf_prefix(ref):
    """The 4-layer model's first L layers and final norm as a function: ids [1, T] -> hidden [1, T, H]."""
    def run(ids):
        out = _text(ref)(input_ids=ids, output_hidden_states=True)
        # hidden_states[L] is layer L-1's output before the final norm (transformers: [embeddings, layer 0, ...])
        return _final_norm(ref)(out.hidden_states[L])
    return run


def _text(ref) -> torch.nn.Module:
    """The transformers model's decoder stack (a multimodal one's text model: GLM-4.5V's)."""
    return getattr(ref.model, "language_model", ref.model)


def _text_config(ref):
    return getattr(ref.config, "text_config", ref.config)


def _final_norm(ref) -> torch.nn.Module:
    return getattr(_text(ref), "norm", None) or _text(ref).norm_f  # (Nemotron-H's name)


def _eps(cfg) -> float:
    return getattr(cfg, "rms_norm_eps", None) or cfg.layer_norm_epsilon


def test_the_converter_keeps_the_mtp_layer_and_drops_it_when_asked(mtp_ckpt, tmp_path) -> None:
    hf, _, _, coli = mtp_ckpt
    with Container(coli) as c:
        names = [n for n in c.names() if n.startswith("mtp.")]
        assert "mtp.0.eh_proj.weight" in names and "mtp.0.norm.weight" in names
        assert any(n.startswith(("mtp.0.block.self_attn.", "mtp.0.block.mixer.")) for n in names)  # (Nemotron-H's)
        # (the step's routed experts: in its one layer, or in its second, Nemotron-H's)
        routed = any(r.startswith(("mtp.0.block.mlp.experts.", "mtp.0.block1.mixer.experts")) for r in c.record_names())
        assert routed != (c.model_type in DENSE)
        assert not any("shared_head.head" in n or "embed_tokens" in n for n in names)  # (the main model's serve)
    dropped = convert(hf, tmp_path / "no-mtp.coli", "f32", 32, progress=False, keep_mtp=False)
    with Container(dropped) as c:
        assert not any(n.startswith("mtp.") for n in c.names())
        # (the layer's input projection, under each layout's name, among the names listed)
        assert any(n.endswith(("eh_proj.weight", "mtp.fc.weight", "mtp_linear_proj.0.weight"))
                   for n in c.meta["converter"]["dropped"])
    with colibri.load(dropped, ctx_size=64, threads=2) as llm, pytest.raises(ColibriError, match="needs the model"):
        llm.submit(PROMPT, 4, speculative="mtp")
    with pytest.raises(ColibriError, match="no multi-token-prediction layer"):
        colibri.load(dropped, ctx_size=64, threads=2, mtp=True)
    from colibri.store import Placement

    with pytest.raises(ColibriError, match="does not combine with GPU layers"):  # (the GPU tier's path on the CPU)
        colibri.load(coli, ctx_size=64, threads=2, mtp=True, placement=Placement(["gpu"] + ["ram"] * (L - 1)),
                     gpu_device="cpu")


def test_the_mtp_layer_matches_transformers_modules(mtp_ckpt) -> None:
    _, ref, extra, coli = mtp_ckpt
    tokens = PROMPT + [17, 40]
    want = _reference(ref, extra, tokens)  # [T, V]
    with colibri.load(coli, ctx_size=64, threads=2, mtp=True) as llm:
        h = load_hf_prefix(ref)(torch.tensor([tokens[:-1]]))[0]
        head = llm._mtp
        got = head._logits(head._forward(tokens[1:], h, [(0, 0, len(tokens) - 1)]))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_mtp_drafts_follow_the_true_context_and_greedy_output_is_plain(mtp_ckpt, monkeypatch) -> None:
    """Every first draft the layer proposes equals its prediction from the true context (transformers' modules,
    above), while the drafts verified are right up to a depth that cycles through 0..3 (the layer's own are
    rarely right on a random model): after prompt chunks, kept and rejected rows alike, and in a next turn that takes
    the cached prompt, its K/V hold the right entries; the tokens equal plain decoding's."""
    _, ref, extra, coli = mtp_ckpt
    seen: list[tuple[int, int]] = []  # (position of the token fed next, the layer's first draft)
    step, turn, full = engine_mtp.MTPHead.step, itertools.count(), []

    def spy(self, hidden, asks):
        out = step(self, hidden, asks)
        for a, d in zip(asks, out):
            if d:
                pos = a.start + len(a.nexts)
                seen.append((pos, d[0]))
                j = next(turn) % 4  # right before draft j
                V = _text_config(ref).vocab_size
                d[:] = [t if i < j else (t + 1) % V for i, t in enumerate(full[pos + 1 : pos + 4])]
        return out

    monkeypatch.setattr(engine_mtp.MTPHead, "step", spy)
    # (prompt chunks of 4 rows: the layer's entries across chunk boundaries)
    with colibri.load(coli, ctx_size=64, threads=2, mtp=True, prefill_chunk=4) as llm:
        llm._mtp.p_min = 0.0
        plain = llm.submit(PROMPT, N, temperature=0, ignore_eos=True, speculative="off").wait()
        full.extend(PROMPT + plain)
        h = llm.submit(PROMPT, N, temperature=0, ignore_eos=True, speculative="mtp", draft_max=3)
        got = h.wait()
        # a conversation's next turn: its prompt a prefix of that context, cached with the layer's entries
        cut = len(PROMPT) + 6
        h2 = llm.submit(full[:cut], len(full) - cut, temperature=0, ignore_eos=True, speculative="mtp", draft_max=3)
        got2 = h2.wait()
        cached = llm._cache_prompt  # (not for the hybrids: a recurrent state does not rewind)
    assert got == plain and got2 == full[cut:] and (h2.stats.cached_tokens > len(PROMPT) or not cached)
    assert 0 < h.stats.accepted < h.stats.drafted and h2.stats.drafted > 0 and len(seen) >= 5
    want = _reference(ref, extra, full).argmax(-1)  # row i: the token after i + 1
    for pos, first in seen:
        assert first == int(want[pos - 1]), (pos, first)


@pytest.mark.parametrize("scheme,streamed", [("f32", False), ("int8", False), ("int8", True)])
def test_mtp_in_batches_with_staggered_joins_gives_plain_tokens(mtp_ckpt, tmp_path, scheme, streamed) -> None:
    """Batched requests joining while others decode, at f32, on the native whole step at int8, and with the
    experts streamed through a small cache (`budget`). A model whose quantized layers run one by one (`PER_LAYER`),
    where a verify is not exact, does not draft at int8, and gives plain tokens."""
    hf, _, _, coli = mtp_ckpt
    if scheme != "f32":
        if not native.available():
            pytest.skip(f"native kernels: {native.why_unavailable()}")
        coli = convert(hf, tmp_path / f"m.{scheme}.coli", scheme, 32, progress=False)
    prompts = [PROMPT, PROMPT[:4] + [7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    # (room for the dense weights, the MTP layer and a few experts: the sparse attentions' indexers and LongCat's
    # two sublayers a layer weigh more, the smaller shapes of MiMo, EXAONE, ERNIE and Mellum less)
    model_type = json.loads((hf / "config.json").read_text())["model_type"]
    budget = {"deepseek_v32": "720K", "glm_moe_dsa": "720K", "longcat_flash": "820K", "mimo_v2_flash": "450K",
              "exaone_moe": "480K", "ernie4_5_moe": "480K", "mellum": "480K"}.get(model_type, "600K")
    budget = budget if streamed else None
    with colibri.load(coli, ctx_size=64, threads=2, slots=3, mtp=True, mem_budget=budget) as llm:
        able = llm._runner.spec.able
        assert budget is None or not able or llm.plan.native_layers().cached  # (experts streamed)
        assert able or (scheme != "f32" and model_type in PER_LAYER)
        llm._mtp.p_min = 0.0
        plain = [llm.submit(p, N, temperature=0, ignore_eos=True).wait() for p in prompts]
        hs = []
        for i, p in enumerate(prompts):  # joins while the others decode
            hs.append(llm.submit(p, N - 3 * i, temperature=0, ignore_eos=True, speculative="mtp", draft_max=2))
            if i == 0:
                next(iter(hs[0]))
        got = [h.wait() for h in hs]
    assert got == [pl[: N - 3 * i] for i, pl in enumerate(plain)]
    assert (sum(h.stats.drafted for h in hs) > 0) == able


def test_cli_inspect_shows_the_mtp_layer_and_run_drafts_with_it(mtp_ckpt, capsys) -> None:
    from colibri.cli import main

    coli = mtp_ckpt[3]
    assert main(["inspect", str(coli), "--no-verify"]) == 0
    assert "mtp:         1 multi-token-prediction layer(s)" in capsys.readouterr().out
    assert main(["plan", "-m", str(coli), "--mtp", "--mem-budget", "64M", "--disk-speed", "1G",
                 "--probe-seconds", "0"]) == 0
    assert "MTP layer: " in capsys.readouterr().out
    assert main(["run", "-m", str(coli), "-p", "hello", "-n", "8", "--temp", "0", "--ctx-size", "64",
                 "--spec", "mtp", "--draft-max", "2", "--stats"]) == 0
    got = re.search(r"drafts (\d+)/(\d+) accepted", capsys.readouterr().err)
    assert got and int(got.group(2)) > 0


def test_the_demos_trained_mtp_layer_drafts_what_the_demo_says() -> None:
    """The shipped MTP layer (tools/make_demo_mtp.py) on the demo at int8: plain tokens, and its first drafts
    mostly right (measured 0.86-0.99 on the bench prompts; a floor under that)."""
    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    from colibri.demo import demo_model

    with colibri.load(demo_model("int8", mtp=True), ctx_size=256, threads=2, mtp=True) as llm:
        ids = llm.tokenizer.encode("Once upon a time")
        plain = llm.submit(ids, 64, temperature=0, ignore_eos=True).wait()
        h = llm.submit(ids, 64, temperature=0, ignore_eos=True, speculative="mtp", draft_max=1)
        got = h.wait()
    assert got == plain
    assert h.stats.draft_reached[0] >= 20 and h.stats.draft_kept[0] / h.stats.draft_reached[0] >= 0.8


def test_sampled_requests_draft_with_the_mtp_layer_and_keep_their_seed(mtp_ckpt, monkeypatch) -> None:
    """A seeded sampled request drafting with the layer (speculative sampling's rule, engine/verify.py): the same
    text on every run, alone or beside another request. Its drafts are all verified whatever the gate would say
    (here: never; its measured times would make the text depend on the machine), an unseeded one's are gated."""
    monkeypatch.setattr(speculative, "choose", lambda gains, *_: [0] * len(gains))
    coli = mtp_ckpt[3]
    kw = dict(temperature=0.8, top_p=0.95, seed=11, ignore_eos=True, speculative="mtp", draft_max=2)
    with colibri.load(coli, ctx_size=64, threads=2, slots=2, mtp=True) as llm:
        llm._mtp.p_min = 0.0
        a = llm.submit(PROMPT, N, **kw)
        one = a.wait()
        b, other = llm.submit(PROMPT, N, **kw), llm.submit(PROMPT[:5], N, **kw)
        two = b.wait()
        other.wait()
        unseeded = llm.submit(PROMPT, N, **{**kw, "seed": None})
        unseeded.wait()
    assert one == two and a.stats.drafted > 0 and b.stats.drafted > 0 and unseeded.stats.drafted == 0
