"""A container's memory limit reaches the planner (colibri/analysis/probe.py `cgroup_free`): /proc/meminfo shows the
host's memory, so a plan from it alone overfilled a memory cgroup. Fake cgroup trees, v1 and v2."""

from __future__ import annotations

from pathlib import Path

from test_plan import machine, synthetic_container

from colibri.analysis import probe
from colibri.analysis.probe import GiB, MiB, cgroup_free
from colibri.plan import CGROUP_HEADROOM, OUR_RAM_HEADROOM, RUNTIME_BYTES, PlanSizes, weights_budget

V1_NO_LIMIT = "9223372036854771712"


def _tree(root: Path, files: dict[str, str], cgroup: str) -> tuple[str, str]:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "self_cgroup").write_text(cgroup)
    return str(root / "self_cgroup"), str(root / "sys")


def test_v1_limit_less_what_is_held_page_cache_counted_free(tmp_path) -> None:
    proc, sys = _tree(tmp_path, {
        "sys/memory/memory.limit_in_bytes": V1_NO_LIMIT, "sys/memory/memory.usage_in_bytes": "1",
        "sys/memory/box/memory.limit_in_bytes": str(4 * GiB),
        "sys/memory/box/memory.usage_in_bytes": str(3 * GiB),
        "sys/memory/box/memory.stat": f"cache 1\nrss 5\ntotal_cache {512 * MiB}\ntotal_rss {2 * GiB}\n",
    }, "12:cpu:/\n4:memory:/box\n0::/\n")
    assert cgroup_free(proc, sys) == GiB + 512 * MiB


def test_v1_the_tightest_ancestor_counts_and_no_limit_is_none(tmp_path) -> None:
    proc, sys = _tree(tmp_path, {
        "sys/memory/outer/memory.limit_in_bytes": str(2 * GiB),
        "sys/memory/outer/memory.usage_in_bytes": str(GiB),
        "sys/memory/outer/inner/memory.limit_in_bytes": V1_NO_LIMIT,
        "sys/memory/outer/inner/memory.usage_in_bytes": str(GiB),
    }, "4:memory,hugetlb:/outer/inner\n")
    assert cgroup_free(proc, sys) == GiB
    proc, sys = _tree(tmp_path / "free", {"sys/memory/a/memory.limit_in_bytes": V1_NO_LIMIT,
                                          "sys/memory/a/memory.usage_in_bytes": "10"}, "4:memory:/a\n")
    assert cgroup_free(proc, sys) is None


def test_v2_memory_max_and_file_pages(tmp_path) -> None:
    proc, sys = _tree(tmp_path, {
        "sys/cgroup.controllers": "cpu memory", "sys/user.slice/memory.max": "max",
        "sys/user.slice/memory.current": str(5 * GiB),
        "sys/user.slice/job/memory.max": str(3 * GiB), "sys/user.slice/job/memory.current": str(2 * GiB),
        "sys/user.slice/job/memory.stat": f"anon {GiB}\nfile {256 * MiB}\n",
    }, "0::/user.slice/job\n")
    assert cgroup_free(proc, sys) == GiB + 256 * MiB
    (tmp_path / "sys/user.slice/job/memory.max").write_text("max")
    assert cgroup_free(proc, sys) is None


def test_no_cgroup_file_is_no_limit(tmp_path) -> None:
    assert cgroup_free(str(tmp_path / "missing"), str(tmp_path)) is None


def test_the_tighter_of_meminfo_and_the_cgroup_is_planned_from(monkeypatch) -> None:
    monkeypatch.setattr(probe, "meminfo", lambda: {"MemAvailable": 20 * GiB, "MemFree": 20 * GiB})
    monkeypatch.setattr(probe, "cgroup_free", lambda: 3 * GiB)
    assert probe.mem_available() == (3 * GiB, True)
    m = probe.current_machine()
    assert m.mem_available == 3 * GiB and m.cgroup
    monkeypatch.setattr(probe, "cgroup_free", lambda: 30 * GiB)
    assert probe.mem_available() == (20 * GiB, False)
    # under a cgroup's limit the plan leaves its page cache a little, not the host's 1 GiB
    sizes = PlanSizes.from_container(synthetic_container(), kv_per_token=0)
    host, capped = machine(3 * GiB), machine(3 * GiB)
    capped.cgroup = True
    assert weights_budget(host, sizes, None, 256) == 3 * GiB - OUR_RAM_HEADROOM - RUNTIME_BYTES
    assert weights_budget(capped, sizes, None, 256) == 3 * GiB - CGROUP_HEADROOM - RUNTIME_BYTES
