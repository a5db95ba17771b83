"""The batched engine: every sequence of a batch gets exactly its solo tokens and transformers' tokens,
whatever joins when, whatever the slots, cache and prefetch; the request API around it."""

from __future__ import annotations

import threading

import pytest
import torch
from hf_tiny import hf_greedy, load_hf
from tiny_configs import DENSE

import colibri
from colibri.engine import EngineClosedError, QueueFullError
from colibri.errors import ColibriError
from colibri.format.container import Container
from colibri.models.family import supported
from colibri.store import Placement, model_sizes

PROMPTS = [[1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3], [1, 88, 5, 61], [1, 230, 12, 9, 77, 41, 130, 2, 66]]
N = 16


def one_slot_per_layer(path, prefetch: bool) -> dict:
    """Every layer's experts on disk behind a cache of exactly one expert per MoE layer."""
    with Container(path) as c:
        s = model_sizes(c)
    slot = max(s.expert_bytes[i] for i in s.moe_layers)
    return dict(placement=Placement(["disk"] * s.n_layers), mem_budget=s.dense_bytes + len(s.moe_layers) * slot,
                prefetch=prefetch)


def staggered(llm, prompts: list[list[int]], n: int, **kw) -> list[list[int]]:
    """Submit each prompt once the previous request has produced a few tokens: requests join the
    decode batch at different steps, and with fewer slots than prompts a slot is reused."""
    handles = []
    for j, p in enumerate(prompts):
        h = llm.submit(p, n, ignore_eos=True, **kw)
        handles.append(h)
        if j + 1 < len(prompts):
            it = iter(h)
            for _ in range(2 + j):
                next(it)
    return [h.wait() for h in handles]


# (the dense families, without experts to cache: tests/test_dense_families.py batches them)
@pytest.mark.parametrize("model_type", [m for m in supported() if m not in DENSE])
def test_batched_sequences_match_solo_and_transformers(ckpt, model_type):
    path = ckpt.coli(model_type, "f32")
    hf = load_hf(ckpt.hf(model_type))
    ref = [hf_greedy(hf, p, N) for p in PROMPTS]
    with colibri.load(path, ctx_size=64, threads=2, slots=1) as solo:
        assert [list(solo.generate_ids(p, N, ignore_eos=True)) for p in PROMPTS] == ref
        assert staggered(solo, PROMPTS, N) == ref  # slots=1: requests queue and reuse the one slot
    settings = {"ram, 2 slots": dict(slots=2), "ram, 3 slots": dict(slots=3)}
    for prefetch in (True, False):
        settings[f"disk 1/layer prefetch={prefetch}"] = dict(slots=2, **one_slot_per_layer(path, prefetch))
    for name, kw in settings.items():
        with colibri.load(path, ctx_size=64, threads=2, **kw) as llm:
            assert staggered(llm, PROMPTS, N) == ref, name
            m = llm.metrics()
            assert m["experts_unique"] < m["experts_summed"], name  # shared experts were fetched once
            if "disk" in name:
                assert llm.store_stats()["misses"] > 0, name


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(ckpt):
    path = ckpt.coli("qwen3_moe", "f32")
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, repeat_penalty=1.1)
    with colibri.load(path, ctx_size=64, threads=2, slots=1) as llm:
        alone = [list(llm.generate_ids(p, N, seed=10 + j, ignore_eos=True, **kw)) for j, p in enumerate(PROMPTS)]
    with colibri.load(path, ctx_size=64, threads=2, slots=3) as llm:
        handles = [llm.submit(p, N, seed=10 + j, ignore_eos=True, **kw) for j, p in enumerate(PROMPTS)]
        assert [h.wait() for h in handles] == alone
    assert len({tuple(t) for t in alone}) == 3


def test_threads_share_one_engine(ckpt):
    path = ckpt.coli("olmoe", "f32")
    with colibri.load(path, ctx_size=64, threads=2, slots=2) as llm:
        solo = [list(llm.generate_ids(p, N, ignore_eos=True)) for p in PROMPTS]
        out: dict[int, list[int]] = {}

        def work(j: int) -> None:
            out[j] = list(llm.generate_ids(PROMPTS[j % 3], N, ignore_eos=True))

        threads = [threading.Thread(target=work, args=(j,)) for j in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [out[j] for j in range(6)] == [solo[j % 3] for j in range(6)]
        texts = llm.generate_batch(["Once upon a time", "The fox", "Hello"], max_tokens=8, ignore_eos=True)
        assert texts == [llm.tokenizer.decode(list(llm.generate_ids(llm.tokenizer.encode(t), 8, ignore_eos=True)))
                         for t in ("Once upon a time", "The fox", "Hello")]


def test_chunked_prefill_and_prompt_logprobs(ckpt):
    path = ckpt.coli("mixtral", "f32")
    long = PROMPTS[0] * 3
    with colibri.load(path, ctx_size=64, threads=2, slots=2) as whole, \
            colibri.load(path, ctx_size=64, threads=2, slots=2, prefill_chunk=5) as chunked:
        want = list(whole.generate_ids(long, N, ignore_eos=True))
        assert list(chunked.generate_ids(long, N, ignore_eos=True)) == want
        ref = whole.logits(long)  # [T, V]
        torch.testing.assert_close(chunked.logits(long), ref, rtol=0, atol=1e-4)  # GEMM blocking only
        h = chunked.submit(long, 0, prompt_logprobs=3)
        assert h.wait() == [] and h.finish_reason == "length"
        logp = torch.log_softmax(ref, -1)
        want = [logp[t - 1, long[t]].item() for t in range(1, len(long))]
        assert h.prompt_token_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(h.prompt_token_logprobs[1:]), torch.tensor(want), atol=1e-4, rtol=0)
        assert [i for i, _ in h.prompt_top_logprobs[1]] == logp[0].topk(3).indices.tolist()
        outs = chunked.logits_batch([PROMPTS[0], PROMPTS[1], long])
        torch.testing.assert_close(outs[2], ref, rtol=0, atol=1e-4)
        assert [o.shape[0] for o in outs] == [12, 4, 36]


def test_cancel_queue_bound_and_close(ckpt):
    path = ckpt.coli("olmoe", "f32")
    llm = colibri.load(path, ctx_size=128, threads=2, slots=1, max_queue=1)
    a = llm.submit(PROMPTS[0], 100, ignore_eos=True)
    next(iter(a))  # a holds the only slot
    b = llm.submit(PROMPTS[1], 4, ignore_eos=True)  # waits in the queue
    with pytest.raises(QueueFullError):
        llm.submit(PROMPTS[2], 4)
    a.cancel()
    assert len(b.wait(60)) == 4 and b.finish_reason == "length"  # the freed slot went to b
    assert a.finish_reason == "cancelled" and len(a.tokens) < 100
    assert llm.health() == {"slots": 1, "busy": 0, "free": 1, "queued": 0, "max_queue": 1}
    it = llm.generate_ids(PROMPTS[0], 50, ignore_eos=True)
    next(it)
    it.close()  # closing the iterator cancels its request
    assert llm.last_stats.finish_reason == "cancelled"
    with pytest.raises(ColibriError, match="max_tokens"):
        llm.submit(PROMPTS[0], 2.5)
    with pytest.raises(ColibriError, match="out of range"):
        llm.logits([1, 10**6])
    llm.close()
    with pytest.raises(EngineClosedError):
        llm.generate_ids(PROMPTS[0], 2).__next__()
    with pytest.raises(EngineClosedError):
        llm.logits(PROMPTS[0])


def test_slots_preallocate_kv(ckpt):
    path = ckpt.coli("deepseek_v2", "f32")  # the MLA latent cache, per slot
    with colibri.load(path, ctx_size=32, slots=1) as one, colibri.load(path, ctx_size=32, slots=3) as three:
        assert three.kv_bytes() == 3 * one.kv_bytes() == 3 * 32 * one.slots.bytes_per_position


def test_steps_with_running_streams_stay_small(ckpt, monkeypatch):
    """While a sequence is decoding, prompts joining it are read in steps of at most the native row
    limit in all (decode rows included); a prompt alone still gets a whole prefill chunk. Tokens are
    those of the sequences alone."""
    from colibri.engine.runner import Runner

    path = ckpt.coli("olmoe", "f32")
    rows: list[tuple[int, int]] = []  # per step: (decode rows, all rows)
    real = Runner._step

    def spy(self, chunks):
        rows.append((sum(1 for c in chunks if c.start >= c.a.prompt_len), sum(len(c.tokens) for c in chunks)))
        return real(self, chunks)

    monkeypatch.setattr(Runner, "_step", spy)
    prompts = [[1 + (7 * j + i) % 90 for j in range(40)] for i in range(3)]
    with colibri.load(path, ctx_size=128, threads=2, slots=1) as solo:
        alone = [list(solo.generate_ids(p, 6, ignore_eos=True)) for p in prompts]
    with colibri.load(path, ctx_size=128, threads=2, slots=3) as llm:
        llm._sched.mixed_rows = 16  # small enough for these prompts to need several steps
        # (else a lone prompt goes 16 rows a step: the next test)
        llm._sched.short_prompt = llm._sched.native_prompt = 0
        rows.clear()
        first = llm.submit(prompts[0], 30, ignore_eos=True)
        next(iter(first))  # decoding now
        late = [llm.submit(p, 6, ignore_eos=True) for p in prompts[1:]]
        got = [[ev.token for ev in h] for h in late]
        list(first)
    assert rows[:2] == [(0, 39), (0, 1)]  # the lone prompt: one step, then its last row alone (scheduler.py)
    assert all(total <= 16 for dec, total in rows[1:] if dec)
    assert any(total - dec > 1 for dec, total in rows[1:] if dec)  # prompts did ride along
    assert got == alone[1:]


def test_short_prompts_go_in_native_sized_steps(ckpt, monkeypatch):
    """A lone prompt is read in steps of `mixed_rows` when it has at most `native_prompt` rows to
    compute, or once at most `short_prompt` of its rows are left (the native kernels' size: faster
    than one GEMM step for short prompts); a longer one gets the prefill chunk first. Tokens do not
    depend on it (f32)."""
    from colibri.engine.runner import Runner

    path = ckpt.coli("olmoe", "f32")
    rows: list[int] = []
    real = Runner._step

    def spy(self, chunks):
        rows.append(sum(len(c.tokens) for c in chunks))
        return real(self, chunks)

    monkeypatch.setattr(Runner, "_step", spy)
    prompt = [1 + (7 * j) % 90 for j in range(100)]
    with colibri.load(path, ctx_size=128, threads=2, slots=1, prefill_chunk=64) as big:
        ref = list(big.generate_ids(prompt, 4, ignore_eos=True))
    with colibri.load(path, ctx_size=128, threads=2, slots=1, prefill_chunk=64) as llm:
        llm._sched.mixed_rows, llm._sched.short_prompt, llm._sched.native_prompt = 16, 48, 99
        rows.clear()
        got = list(llm.generate_ids(prompt, 4, ignore_eos=True))
        assert rows[:5] == [64, 16, 16, 4, 1]  # 100 rows > 99: 64 (36 left <= 48), 16-row steps, decode
        llm._sched.native_prompt = 100
        rows.clear()
        again = list(llm.generate_ids(prompt[:-1] + [3], 4, ignore_eos=True))  # 99 of its rows cached
        assert rows[:2] == [1, 1]
        rows.clear()
        got_native = list(llm.generate_ids(prompt, 4, ignore_eos=True, prompt_logprobs=0))  # (no cache)
        assert rows[:9] == [16] * 6 + [4, 1, 1]  # 100 rows <= 100: native-sized steps throughout
    assert got == ref == got_native and len(again) == 4


def test_a_request_whose_sampling_fails_ends_alone(ckpt) -> None:
    """A request whose picking raises after its step (logits / 1e-300: no finite value to sample) ends with the
    error; the engine thread goes on and the next request decodes as before."""
    import colibri

    with colibri.load(ckpt.coli("olmoe", "f32"), ctx_size=32, threads=2) as llm:
        want = list(llm.generate_ids([1, 2, 3], 4, temperature=0, ignore_eos=True))
        with pytest.raises(ValueError, match="cannot sample"):
            list(llm.generate_ids([1, 2, 3], 4, temperature=1e-300, ignore_eos=True))
        assert list(llm.generate_ids([1, 2, 3], 4, temperature=0, ignore_eos=True)) == want
