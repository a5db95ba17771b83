"""Memory tiers: output is bit-identical whatever the placement, cache size, prefetch and I/O mode;
budgets hold; stats add up. Runs the GPU tier's code path on the CPU (gpu_device="cpu")."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_configs import DENSE

import colibri
from colibri import arena
from colibri.api import Engine
from colibri.arena import aligned_buffer
from colibri.cli import main as cli_main
from colibri.format.container import Container
from colibri.models.family import supported
from colibri.plan import auto_placement
from colibri.quant import QLinear, bias_bytes, owned_bytes, stored_linear
from colibri.store import Placement, model_sizes
from colibri.store import reader as reader_mod
from colibri.store.reader import RecordReader

PROMPT = [1, 17, 42, 99, 7, 150, 23, 64, 5, 200, 11, 3]
N_GREEDY = 24
FAMILIES = [m for m in supported() if m not in DENSE]  # (the tiers place experts: the dense families have none)
_REF: dict[Path, tuple[list[int], torch.Tensor]] = {}


def run(path: Path, **kw) -> tuple[list[int], torch.Tensor, dict]:
    llm = Engine(path, ctx_size=128, threads=2, **kw)
    try:
        tokens = list(llm.generate_ids(PROMPT, N_GREEDY, temperature=0, ignore_eos=True))
        logits = llm.logits(PROMPT * 3)  # prefill path: several tokens per expert
        return tokens, logits, llm.store_stats()
    finally:
        llm.close()


def reference(path: Path) -> tuple[list[int], torch.Tensor]:
    if path not in _REF:
        tokens, logits, stats = run(path, mmap=True)  # the baseline: every weight a view of the mapping
        assert stats["placement"].endswith("ram layers") and not stats["read_mode"]
        _REF[path] = tokens, logits
    return _REF[path]


def configs(path: Path) -> dict[str, dict]:
    """Tier splits and cache sizes down to one expert per disk layer, and to one expert in all."""
    with Container(path) as c:
        s = model_sizes(c)
    n, moe = s.n_layers, s.moe_layers
    slot = max(s.expert_bytes[i] for i in moe)
    disk = Placement(["disk"] * n)
    per_layer = s.dense_bytes + len(moe) * slot  # exactly one slot per MoE layer
    half = ["ram"] * (n // 2) + ["disk"] * (n - n // 2)
    half_budget = s.dense_bytes + sum(s.layer_experts_bytes(i) for i in range(n // 2)) + 2 * slot
    return {
        "disk-1-per-layer": dict(placement=disk, mem_budget=per_layer),
        "disk-1-slot": dict(placement=disk, mem_budget=s.dense_bytes + slot),
        "disk-1-per-layer-noprefetch-buffered": dict(placement=disk, mem_budget=per_layer, prefetch=False,
                                                     direct_io=False),
        "disk-unbudgeted": dict(placement=disk),
        "ram-disk": dict(placement=Placement(half), mem_budget=half_budget),
        "gpu-ram-disk": dict(placement=Placement(["gpu"] + ["ram"] * (n - 2) + ["disk"]), gpu_device="cpu"),
        "gpu-cache-1-slot": dict(placement=Placement(["gpu"] * n), gpu_device="cpu",
                                 gpu_budget=_gpu_dense(path) + slot),
        "auto-below-size": dict(mem_budget=s.total_bytes - 1),
        "pinned": dict(placement=Placement(["disk"] * n, pinned={moe[0]: [0, 1]}),
                       mem_budget=per_layer + 2 * slot),
    }


def _gpu_dense(path: Path) -> int:
    """What the GPU layers' dense weights take on the device (copies are not padded to 4096)."""
    llm = Engine(path, ctx_size=8, placement=Placement(["gpu"] * model_sizes(Container(path)).n_layers),
                 gpu_device="cpu")
    n = llm.store_stats()["gpu_dense_bytes"]
    llm.close()
    return n


def assert_identical(path: Path, name: str, kw: dict) -> dict:
    ref_tokens, ref_logits = reference(path)
    tokens, logits, stats = run(path, **kw)
    assert tokens == ref_tokens, name
    assert torch.equal(logits, ref_logits), name
    return stats


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_tier_split_and_cache_size_is_bit_identical_f32(ckpt, model_type):
    path = ckpt.coli(model_type, "f32")
    for name, kw in configs(path).items():
        stats = assert_identical(path, name, kw)
        if name == "disk-1-per-layer":
            assert stats["cache_slots"] == len(model_sizes(Container(path)).moe_layers)
        if name == "disk-1-slot":
            assert stats["cache_slots"] == 1
        if kw.get("mem_budget") is not None:
            assert stats["resident_bytes"] <= kw["mem_budget"], name
        if "disk" in name or name == "auto-below-size":
            assert stats["bytes_read"] > 0, name  # (a prefetch may have read them all before use)
        if "-1-" in name:
            assert stats["misses"] > 0, name
        if name == "gpu-cache-1-slot":
            assert stats["gpu_cache_slots"] == 1 and stats["misses"] > 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_quantized_bf16_paths_are_bit_identical(ckpt, model_type, scheme):
    """bf16 compute: the fused int8/int4 kernels (int4 repacks per loaded expert) must give
    the same bits from a cache slot as from the mapped file (DeepSeek: its MLA block next to cached experts;
    ranks of 32s, which int4 groups need)."""
    path = ckpt.coli(model_type, scheme, **({"q_lora_rank": 32, "kv_lora_rank": 32} if model_type == "deepseek_v3"
                                           else {}))
    for name in ("disk-1-per-layer", "disk-1-slot", "ram-disk", "gpu-cache-1-slot"):
        assert_identical(path, name, configs(path)[name])


@pytest.mark.parametrize("model_type,scheme", [("olmoe", "f32"), ("olmoe", "int8"), ("olmoe", "int4"),
                                               ("gpt_oss", "int8"), ("gpt_oss", "int4")])
def test_refilled_slots_reuse_their_modules(ckpt, model_type, scheme):
    """A slot's modules are built once; later loads only refresh what derives from the bytes
    (int8 scale cast, int4 repack, bias cast), and the output stays the same."""
    path = ckpt.coli(model_type, scheme)
    kw = configs(path)["disk-1-slot"]
    llm = Engine(path, ctx_size=128, threads=2, **kw)
    tokens = list(llm.generate_ids(PROMPT, N_GREEDY, temperature=0, ignore_eos=True))
    stats, loader = llm.store_stats(), llm.store.loader
    llm.close()
    assert tokens == reference(path)[0]
    assert stats["cache_slots"] == 1 and stats["reads"] > 10
    assert loader.builds == 1


def test_stats_add_up(ckpt):
    path = ckpt.coli("olmoe", "f32")
    s = model_sizes(Container(path))
    kw = configs(path)["disk-1-per-layer"]
    llm = Engine(path, ctx_size=128, threads=2, **kw)
    list(llm.generate_ids(PROMPT, 16, temperature=0, ignore_eos=True))
    run_stats, total = llm.last_stats.extra["store"], llm.store_stats()
    llm.close()
    for key in ("hits", "misses", "hit_rate", "bytes_read", "bytes_per_token", "decode_bytes_per_token",
                "prefetch_precision", "prefetch_recall", "resident_bytes", "cache_slots", "io_wait_s",
                "direct_io", "placement", "tokens", "prefetch_issued", "prefetch_used"):
        assert key in total, key
    assert total["prefill_tokens"] == len(PROMPT) and total["decode_tokens"] == 15
    assert total["tokens"] == run_stats["tokens"] == len(PROMPT) + 15
    assert total["hits"] + total["misses"] == total["lookups"] > 0
    assert 0 < total["hit_rate"] < 1
    assert total["bytes_read"] == total["reads"] * s.record_bytes[0]
    assert total["bytes_read"] == total["prefill_bytes_read"] + total["decode_bytes_read"]
    assert total["bytes_per_token"] == pytest.approx(total["bytes_read"] / total["tokens"])
    assert total["pred_total"] > 0 and 0 <= total["prefetch_precision"] <= 1
    # One token's look-ahead per layer and decode step after the first layer (k experts each).
    assert total["pred_total"] == 15 * (s.n_layers - 1) * s.top_k
    assert total["resident_bytes"] == total["dense_bytes"] + total["cache_bytes"] <= kw["mem_budget"]


def test_stats_count_rows_per_step_in_a_batch(ckpt):
    """Two sequences decoding together: every one-row-per-sequence decode counts as a decode token
    (the runner counts per step; a rule on the forward's row count would call a 2-row step prefill)."""
    path = ckpt.coli("olmoe", "f32")
    llm = Engine(path, ctx_size=64, threads=2, slots=2, **configs(path)["disk-1-per-layer"])
    try:
        handles = [llm.submit(p, 6, temperature=0, ignore_eos=True) for p in (PROMPT, PROMPT[:5])]
        for h in handles:
            assert len(list(h)) == 6
        m = llm.metrics()
    finally:
        llm.close()
    total = m["store"]
    assert total["prefill_tokens"] == len(PROMPT) + 5
    assert total["decode_tokens"] == m["decode_rows"] == 2 * 5  # 6 tokens each: the last is never fed back
    assert total["bytes_read"] == total["prefill_bytes_read"] + total["decode_bytes_read"] > 0


def test_prefetch_off_issues_nothing(ckpt):
    path = ckpt.coli("olmoe", "f32")
    _, _, stats = run(path, **configs(path)["disk-1-per-layer-noprefetch-buffered"])
    assert stats["prefetch_issued"] == stats["pred_total"] == 0
    assert not stats["prefetch"] and not stats["direct_io"]


def _model_tensors(llm) -> list[torch.Tensor]:
    out = [t for t in llm.model.state_dict(keep_vars=True).values()]
    out += [b for m in llm.model.modules() for b in m.buffers(recurse=False)]
    out.append(llm.model.model.embed_tokens.weight)
    for layer in llm.model.model.layers:
        src = getattr(getattr(layer.mlp, "experts", None), "source", None)
        for w in getattr(getattr(src, "inner", None), "experts", []):
            out += list(w.gate_up.buffers()) + list(w.down.buffers())
    return [t for t in out if t is not None and t.numel()]


@pytest.mark.parametrize("budget,mmap", [(None, True), (None, False), (1 << 30, False), (1 << 30, True)])
def test_read_mode_never_uses_the_mapping(ckpt, budget, mmap):
    """By default and with a budget, every weight lives in engine-owned memory, none in the container's
    mmap (whose pages would count in RSS outside the budget, and which the kernels read slower); only
    `mmap=True` without a budget leaves the weights mapped."""
    path = ckpt.coli("qwen2_moe", "int8")
    llm = Engine(path, ctx_size=64, threads=2, mem_budget=budget, mmap=mmap,
                 placement=Placement(["ram", "ram", "disk"]))
    mm = llm.container._mm
    import ctypes
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    mapped = [t for t in _model_tensors(llm) if base <= t.data_ptr() < base + len(mm)]
    assert len(_model_tensors(llm)) > 50
    if budget is None and mmap:
        assert mapped and not llm.store_stats()["read_mode"]  # (so the check below can see a mapping)
    else:
        assert mapped == [] and llm.store_stats()["read_mode"]
    llm.close()


def test_budget_too_small_is_a_clear_error(ckpt):
    path = ckpt.coli("olmoe", "f32")
    with pytest.raises(Exception, match="mem-budget"):
        Engine(path, ctx_size=64, placement=Placement(["disk"] * 3), mem_budget=1000)
    with pytest.raises(Exception, match="too small"):
        Engine(path, ctx_size=64, placement=Placement(["ram"] * 3), mem_budget=100_000)


def test_planner_places_experts_on_disk_under_a_budget(ckpt):
    """The Engine's default placement is the planner's (colibri/plan.py), with the store's accounting."""
    path = ckpt.coli("olmoe", "f32")
    c = Container(path)
    s = model_sizes(c)
    assert auto_placement(c, mem_budget=s.total_bytes).tiers == ["ram"] * 3
    budget = s.dense_bytes + 3 * s.top_k * max(s.expert_bytes)
    assert budget < s.total_bytes
    assert auto_placement(c, mem_budget=budget).tiers == ["disk"] * 3
    _, _, stats = run(path, mem_budget=budget)
    assert stats["tiers"] == ["disk"] * 3
    assert stats["resident_bytes"] <= budget


@pytest.mark.parametrize("family,scheme", [("qwen3_moe", "f32"), ("qwen3_moe", "int8"), ("qwen3_moe", "int4"),
                                           ("gpt_oss", "f16"), ("gpt_oss", "int8")])
def test_extra_bytes_estimate_matches_qlinear(ckpt, family, scheme):
    """model_sizes' per-expert cost must be what the modules really allocate (budgets depend on it),
    biases included (gpt-oss; an f16 file computes in bf16, so every weight and bias is cast)."""
    path = ckpt.coli(family, scheme)
    with Container(path) as c:
        dtype = torch.float32 if scheme == "f32" else torch.bfloat16
        checked = 0
        for name in c.names():
            info = c.info(name)
            if "quant" not in info and not name.endswith(("proj.weight", "up.weight", "down.weight")):
                continue
            tensors = {s: c.tensor(name + s) for s in ("", ".scale", ".min") if c.has(name + s)}
            bias = name.removesuffix(".weight") + ".bias"
            b = c.tensor(bias) if c.has(bias) else None
            q = stored_linear(tensors, info, b, dtype)
            assert isinstance(q, QLinear)
            assert owned_bytes(info, dtype) + (bias_bytes(c.info(bias), dtype) if b is not None else 0) == q.nbytes
            checked += 1
        assert checked > 0


# ----------------------------------------------------------------------------- reader


def test_reader_direct_and_buffered_read_the_same_bytes(ckpt):
    path = ckpt.coli("olmoe", "int8")
    with Container(path) as c:
        names = c.record_names()[:3]
        recs = [c.record(n) for n in names]
        want = [c.tensor(c.record(n)["tensors"]["down.weight"]).clone() for n in names]
    for direct in (True, False):
        r = RecordReader(path, threads=2, direct=direct)
        with Container(path) as c:
            for n, rec, w in zip(names, recs, want):
                buf = aligned_buffer(rec["nbytes"] + 4096)
                r.read_into(buf, rec["offset"], rec["nbytes"])
                assert torch.equal(c.record_views(n, buf)["down.weight"], w)
        assert r.direct == direct
        assert r.bytes_read == sum(rec["nbytes"] for rec in recs)
        r.close()


def test_reader_falls_back_when_o_direct_is_refused(ckpt, monkeypatch):
    path = ckpt.coli("olmoe", "int8")
    r = RecordReader(path, threads=1, direct=True)
    if not r.direct:
        pytest.skip("this filesystem refuses O_DIRECT at open (already the fallback)")
    real = os.preadv

    def refuse(fd, bufs, off):
        if fd == r._dfd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    monkeypatch.setattr(reader_mod.os, "preadv", refuse)
    with Container(path) as c:
        rec = c.record(c.record_names()[0])
        buf = aligned_buffer(rec["nbytes"] + 4096)
        r.read_into(buf, rec["offset"], rec["nbytes"])
        assert torch.equal(c.record_views(c.record_names()[0], buf)["down.weight"],
                           c.tensor(rec["tensors"]["down.weight"]))
    assert not r.direct
    r.close()
    # ... and the engine's output is still the same with the fallback in force
    assert_identical(path, "refused", configs(path)["disk-1-per-layer"])


def test_reader_on_tmpfs_falls_back_at_open(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    f = shm / f"colibri-test-{os.getpid()}.bin"
    f.write_bytes(bytes(range(256)) * 64)
    try:
        r = RecordReader(f, threads=1, direct=True)
        buf = aligned_buffer(8192)
        r.read_into(buf, 4096, 256)
        assert buf[:256].tolist() == list(range(256))
        r.close()
    finally:
        f.unlink()


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of this process's mapping that holds `addr` (Linux /proc), or None."""
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = lo <= addr < hi
            elif cur and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


def test_large_arenas_ask_for_huge_pages(monkeypatch):
    """Arenas of 4 MiB and more carry MADV_HUGEPAGE (VmFlags "hg"), smaller ones do not, KV caches
    included; where the kernel refuses the advice the buffer is still made, zeroed, as without it."""
    if not os.path.exists("/proc/self/smaps") or arena.HUGE_ADVICE is None:
        pytest.skip("Linux /proc and MADV_HUGEPAGE needed")
    big, small = aligned_buffer(6 << 20), aligned_buffer(1 << 20)
    flags_big, flags_small = _vm_flags(big.data_ptr()), _vm_flags(small.data_ptr())
    assert flags_big is not None and "hg" in flags_big
    assert flags_small is not None and "hg" not in flags_small
    # a layer's KV cache preallocated for a long context: its own huge-page arena, zeros as torch.zeros's
    from colibri.layers.attention import KVCache
    kv = KVCache(4, 64, 8192, torch.bfloat16)  # [4, 8192, 64] bf16 = 4 MiB each
    assert kv.k.shape == (4, 8192, 64) and kv.k.dtype == torch.bfloat16 and not kv.v.any()
    assert "hg" in (_vm_flags(kv.k.data_ptr()) or []) and "hg" in (_vm_flags(kv.v.data_ptr()) or [])
    kv.update(torch.ones(4, 3, 64, dtype=torch.bfloat16), torch.ones(4, 3, 64, dtype=torch.bfloat16), 5)
    assert int(kv.k.sum()) == 4 * 3 * 64 and kv.k[:, 5:8].eq(1).all()
    short = KVCache(4, 64, 256, torch.bfloat16)  # (128 KiB: a plain tensor)
    assert "hg" not in (_vm_flags(short.k.data_ptr()) or [])
    monkeypatch.setattr(arena, "HUGE_ADVICE", -1)  # an advice the kernel refuses (EINVAL)
    b = aligned_buffer(5 << 20)
    assert b.numel() == 5 << 20 and int(b[::4096].sum()) == 0 and "hg" not in (_vm_flags(b.data_ptr()) or [])


def test_a_slots_caches_share_one_huge_page_arena(ckpt, monkeypatch):
    """`arena.pooled`: small caches carved from one page-aligned arena (huge pages where a layer's own
    would be too small for them); what does not fit gets its own. An engine's slots take one arena each,
    and decode the same tokens as with torch's tensors."""
    if not os.path.exists("/proc/self/smaps") or arena.HUGE_ADVICE is None:
        pytest.skip("Linux /proc and MADV_HUGEPAGE needed")
    with arena.pooled(5 << 20):
        a, b = arena.zeros((4, 256, 64), torch.bfloat16), arena.zeros((3, 100), torch.float32)
        c = arena.zeros((10,), torch.bfloat16)  # (after b's 1,200 bytes: the next page)
        big = arena.zeros((6 << 20,), torch.uint8)  # (does not fit: an arena of its own)
    assert b.data_ptr() - a.data_ptr() == 128 << 10 and c.data_ptr() - b.data_ptr() == 4096
    assert all("hg" in (_vm_flags(t.data_ptr()) or []) for t in (a, b, big)) and not a.any() and not b.any()
    assert not a.data_ptr() <= big.data_ptr() < a.data_ptr() + (5 << 20)
    assert "hg" not in (_vm_flags(arena.zeros((4, 256, 64), torch.bfloat16).data_ptr()) or [])  # no pool: torch

    path = ckpt.coli("olmoe", "f32")
    prompt = [1, 17, 42, 99, 7]
    with colibri.load(path, ctx_size=16384, slots=2, threads=1) as llm:
        k0 = llm.slots.caches[0][0].k
        assert k0.numel() * 4 < arena.HUGE_MIN and "hg" in (_vm_flags(k0.data_ptr()) or [])
        assert llm.slots.caches[1][0].k.data_ptr() != k0.data_ptr()
        pooled = list(llm.generate_ids(prompt, 12, ignore_eos=True))
    monkeypatch.setattr(arena, "HUGE_MIN", 1 << 40)  # every cache a torch tensor
    with colibri.load(path, ctx_size=16384, slots=2, threads=1) as llm:
        assert "hg" not in (_vm_flags(llm.slots.caches[0][0].k.data_ptr()) or [])
        assert list(llm.generate_ids(prompt, 12, ignore_eos=True)) == pooled


# ----------------------------------------------------------------------------- CLI and RSS


def test_cli_stats_line(ckpt, capsys):
    path = ckpt.coli("olmoe", "int8")
    rc = cli_main(["--model", str(path), "-p", "hello world", "-n", "8", "--temp", "0", "--ignore-eos",
                   "--disk-layers", "2", "--mem-budget", "10M", "--stats", "--no-direct-io"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "1 ram, 2 disk layers" in err and "hit rate" in err and "MiB/token" in err
    assert "prefetch precision" in err and "buffered" in err
    if os.path.exists("/proc/self/smaps_rollup"):  # (Linux: how much of the process sits in huge pages)
        assert re.search(r"peak RSS \d+ MiB, weights resident \d+ MiB, \d+ MiB in huge pages", err)


_RSS_SCRIPT = """
import json, sys, torch
from colibri.api import Engine
from colibri.store import Placement
path, budget = sys.argv[1], int(sys.argv[2])
llm = Engine(path, ctx_size=64, threads=1, placement=Placement(["disk"] * 4), mem_budget=budget)
list(llm.generate_ids(list(range(3, 35)), 16, temperature=0, ignore_eos=True))
s = llm.store_stats()
# VmHWM, not ru_maxrss: ru_maxrss survives exec, so it would report pytest's own peak
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps({"rss": hwm * 1024,
                  "resident": s["resident_bytes"], "misses": s["misses"]}))
"""


def test_peak_rss_tracks_the_budget(ckpt):
    """Peak RSS grows with the budget, never by more than it: RSS(B) - RSS(minimal) <= B - minimal
    (+ slack for allocator noise). The model's experts are several times the larger budget."""
    path = ckpt.coli("olmoe", "int8", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_experts=16, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4)
    s = model_sizes(Container(path))
    lo = s.dense_bytes + len(s.moe_layers) * s.expert_bytes[0]
    hi = lo + 16 * s.expert_bytes[0]
    assert sum(s.layer_experts_bytes(i) for i in s.moe_layers) > 3 * (hi - s.dense_bytes)

    def peak(budget: int) -> dict:
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), str(budget)], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    a, b = peak(lo), peak(hi)
    assert a["resident"] <= lo and b["resident"] <= hi
    assert a["misses"] > b["misses"] > 0
    slack = 8 << 20
    assert b["rss"] - a["rss"] <= (hi - lo) + slack, (a, b)


def test_loading_resident_experts_draws_a_bar_on_a_terminal(ckpt, monkeypatch, capsys):
    """Reading experts into engine memory takes seconds on a large model: a progress bar on a terminal, from
    LOAD_BAR_BYTES on (none for a small model, none off a terminal)."""
    from colibri.store import tiered

    path = ckpt.coli("olmoe", "int8")
    Engine(path, ctx_size=16, threads=1).close()
    assert "loading" not in capsys.readouterr().err  # (small, and stderr is no terminal here)
    real = tiered.Progress
    monkeypatch.setattr(tiered, "LOAD_BAR_BYTES", 0)  # ... and as if it were one:
    monkeypatch.setattr(tiered, "Progress", lambda *a, enabled=None, **k: real(*a, enabled=enabled is not False, **k))
    Engine(path, ctx_size=16, threads=1).close()
    err = capsys.readouterr().err
    n = sum(model_sizes(Container(path)).n_experts)
    assert f"loading {n} experts: [" in err and "100.0%" in err.splitlines()[-1]
