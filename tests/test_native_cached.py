"""Cached (disk-tier) layers in the one-call native step (engine/native_step.py, engine/stream_hook.py,
store/cache.py `track`, kernels/step.c moe_streamed): the call runs over the experts in memory; at a route to
one that is not, the layer's hook starts its read, the kernel computes the others and waits for it inside the
call -- the bits of the all-RAM engine, whatever the cache holds."""

from __future__ import annotations

import pytest
import torch
from test_tiers import N_GREEDY, PROMPT, configs

from colibri.api import Engine
from colibri.engine import stream_hook
from colibri.format.container import Container
from colibri.kernels import native
from colibri.store import Placement, model_sizes

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")

FAMILIES = [("olmoe", {}), ("qwen2_moe", {"shared_expert_intermediate_size": 64}), ("gpt_oss", {}),
            ("deepseek_v3", {"n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 32})]


def _spy_stops(mp: pytest.MonkeyPatch) -> list[int | None]:
    """The stop layer each native call returns from now on (None: it ran to the end); then, appended as
    "landed", each time a layer's hook let the kernel go on with an expert whose read landed inside a call."""
    stops: list[int | None] = []
    real, whole, wait = native.decode_layers, native.decode_step, stream_hook.LayerHook._wait

    def spy(*a, **k):
        out = real(*a, **k)
        stops.append(out[2])
        return out

    def spy_whole(*a, **k):
        out = whole(*a, **k)
        stops.append(None if out is not None else "missed")
        return out

    def spy_wait(self):
        got = wait(self)
        if got == 1:
            stops.append("landed")
        return got

    mp.setattr(native, "decode_layers", spy)
    mp.setattr(native, "decode_step", spy_whole)
    mp.setattr(stream_hook.LayerHook, "_wait", spy_wait)
    return stops


def _run(path, monkeypatch, **kw) -> tuple[list[int], torch.Tensor, dict, list[int | None]]:
    """Greedy tokens, a prompt's logits, the store's stats, and what each native call returned as its stop
    layer (None: it ran to the end)."""
    with monkeypatch.context() as mp:
        stops = _spy_stops(mp)
        llm = Engine(path, ctx_size=128, threads=2, **kw)
        try:
            tokens = list(llm.generate_ids(PROMPT, N_GREEDY, temperature=0, ignore_eos=True))
            tokens += list(llm.generate_ids(PROMPT[:5], N_GREEDY, temperature=0, ignore_eos=True))
            logits = llm.logits(PROMPT * 3)
            return tokens, logits, llm.store_stats(), stops
        finally:
            llm.close()


def _all_fit(path) -> dict:
    """Every layer on the disk tier with a cache that holds every expert (all hits once read)."""
    with Container(path) as c:
        s = model_sizes(c)
    budget = s.dense_bytes + sum(s.layer_experts_bytes(i) for i in range(s.n_layers)) + (64 << 20)
    return dict(placement=Placement(["disk"] * s.n_layers), mem_budget=budget)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model_type,overrides", FAMILIES)
def test_cached_layers_run_in_the_one_call_step_bit_for_bit(ckpt, monkeypatch, model_type, overrides, scheme):
    path = ckpt.coli(model_type, scheme, **overrides)
    ref_tokens, ref_logits, ref_stats, _ = _run(path, monkeypatch)  # (whole steps: coli_decode_step)
    assert ref_stats["placement"].endswith("ram layers")
    for name, kw in (("all-fit", _all_fit(path)), ("disk-1-per-layer", configs(path)["disk-1-per-layer"]),
                     ("ram-disk", configs(path)["ram-disk"])):
        tokens, logits, stats, stops = _run(path, monkeypatch, **kw)
        assert tokens == ref_tokens, name
        assert torch.equal(logits, ref_logits), name
        assert stats["bytes_read"] > 0, name
        assert None in stops and all(s in (None, "landed") for s in stops), name  # the native call, to the end
        if name == "disk-1-per-layer":
            assert "landed" in stops, name  # ... waiting inside it for the experts not in memory


def test_hooked_fetches_count_every_lookup(ckpt, monkeypatch):
    """Each cached layer of a native call fetches through its hook: the cache sees as many lookups as on the
    per-layer path (one per routed expert id per layer and step), the later ones hits."""
    from colibri.engine import native_step

    path = ckpt.coli("olmoe", "int8")
    kw = _all_fit(path)
    tokens, _, stats, stops = _run(path, monkeypatch, **kw)
    monkeypatch.setattr(native_step, "build", lambda *a, **k: "asked for torch")
    tokens_py, _, stats_py, stops_py = _run(path, monkeypatch, **kw)
    assert tokens == tokens_py and stops and not stops_py
    assert stats["hits"] + stats["misses"] == stats_py["hits"] + stats_py["misses"] > 0
    with Container(path) as c:
        n_experts = sum(model_sizes(c).n_experts)
    assert stats["misses"] <= n_experts  # every expert read at most once: the cache holds them all
    assert stats["hits"] > stats["misses"]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_batched_steps_over_cached_layers_match_ram(ckpt, monkeypatch, scheme):
    """Several sequences a step (rows of different positions, the union of their experts), prompts of different
    lengths submitted together: the cached one-call steps give every sequence the tokens of the all-RAM engine."""
    path = ckpt.coli("qwen2_moe", scheme, shared_expert_intermediate_size=64)
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:11]]

    def tokens(**kw) -> tuple[list[list[int]], list[int | None]]:
        with monkeypatch.context() as mp:
            stops = _spy_stops(mp)
            llm = Engine(path, ctx_size=128, threads=2, slots=3, **kw)
            try:
                hs = [llm.submit(p, 12, temperature=0, ignore_eos=True) for p in prompts]
                return [[e.token for e in h] for h in hs], stops
            finally:
                llm.close()

    ref, _ = tokens()
    for kw in (_all_fit(path), configs(path)["disk-1-per-layer"]):
        got, stops = tokens(**kw)
        assert got == ref and stops


def test_a_read_failing_inside_the_call_fails_its_request_and_releases_the_claims(ckpt, monkeypatch):
    """A read that fails while the one-call step waits for it: the request fails with the reader's own error
    (raised out of the kernel's hook), no expert stays claimed, and the next request decodes as before."""
    from colibri.store import reader as reader_mod

    path = ckpt.coli("olmoe", "int8")
    llm = Engine(path, ctx_size=128, threads=2, **configs(path)["disk-1-per-layer"])
    try:
        ref = list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True))
        real = reader_mod._pread_full

        def broken(*a):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(reader_mod, "_pread_full", broken)
        with pytest.raises(Exception, match="Input/output error"):
            list(llm.generate_ids(PROMPT[3:], 8, temperature=0, ignore_eos=True))
        monkeypatch.setattr(reader_mod, "_pread_full", real)
        caches = llm.store.caches.values()
        assert caches and all(s.users == 0 for c in caches for s in c.slots)
        assert list(llm.generate_ids(PROMPT, 8, temperature=0, ignore_eos=True)) == ref
    finally:
        llm.close()


@pytest.mark.parametrize("model_type,overrides", FAMILIES[:2])
def test_the_kernels_look_ahead_predicts_what_the_torch_look_ahead_does(ckpt, monkeypatch, model_type, overrides):
    """The one-call step's kernel applies the next routed layer's norm and router to a layer's residual: the
    routes it hands the hook are those store/lookahead.py's torch form predicts from the same residual."""
    import ctypes

    import numpy as np

    path = ckpt.coli(model_type, "int8", **overrides)
    compared: list[int] = []
    real = stream_hook.LayerHook._routed

    def check(self, layer, idx, n, h, pred, n_pred):
        ahead = self.source.ahead
        if n_pred and h:
            T = n // self.k
            resid = torch.frombuffer((ctypes.c_uint16 * (T * self.hidden)).from_address(h), dtype=torch.bfloat16)
            _, norm, gate, _ = ahead.next[layer]
            want = gate(norm(resid.view(T, self.hidden).clone()))[0]
            assert np.ctypeslib.as_array(pred, (n_pred,)).tolist() == want.reshape(-1).tolist(), layer
            compared.append(layer)
        return real(self, layer, idx, n, h, pred, n_pred)

    monkeypatch.setattr(stream_hook.LayerHook, "_routed", check)
    llm = Engine(path, ctx_size=128, threads=2, **configs(path)["disk-1-per-layer"])
    try:
        list(llm.generate_ids(PROMPT, 6, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    assert len(compared) >= 6  # (every step, at least one layer)
