"""The streamed-decode limit: how fast decode could go, given this run's disk and compute.

A decode token needs its expert reads (bytes per token at the bandwidth the reader achieved) and
its in-RAM step (everything but waiting on those reads). With reads overlapping compute, the
best a run can do is 1 / max(the two); the share reached says how much the overlap leaves on the
table. Every figure comes from the store's counters over the decode steps (TieredStore.count_step)
and the decode wall time; docs/TIERS.md, "The streamed limit", says what each one measures.
"""

from __future__ import annotations

__all__ = ["decode_limit", "limit_text"]


def decode_limit(s: dict, decode_s: float, tokens: int) -> dict:
    """The limit figures of one run: `s` is the store's stats over it (`stats_delta`), `decode_s` the
    wall time of its decode and `tokens` the tokens decoded in it (prefill's first token excluded).

    Keys: decode_bytes_read_per_token; read_bandwidth_bps (None: nothing read while decoding);
    decode_io_wait_s, io_wait_s_per_token and in_ram_step_s (the last two add up to decode_s / tokens);
    disk_s_per_token; limit_tok_s; limit_bound ("disk", "compute", or "ram" when decoding read
    nothing, the limit then being the in-RAM step); limit_share. Those that need a timed decoded
    token are None without one.
    """
    bpt = s.get("decode_bytes_per_token", 0.0)
    bw = s.get("decode_read_bps", 0.0) or None
    wait = s.get("decode_io_wait_s", 0.0)
    out: dict = dict.fromkeys(("io_wait_s_per_token", "in_ram_step_s", "disk_s_per_token", "limit_tok_s",
                               "limit_bound", "limit_share"))
    out.update(decode_bytes_read_per_token=bpt, read_bandwidth_bps=bw, decode_io_wait_s=wait)
    if tokens <= 0 or decode_s <= 0:
        return out
    step = max(decode_s - wait, 0.0) / tokens
    # (no bandwidth with bytes read only if every read the decode started ran after its last step:
    # the disk term is then unknown, and left out)
    disk = (bpt / bw if bw else None) if bpt > 0 else 0.0
    per_token = max(disk or 0.0, step)
    out.update(io_wait_s_per_token=wait / tokens, in_ram_step_s=step, disk_s_per_token=disk,
               limit_bound="ram" if bpt == 0 else ("disk" if (disk or 0.0) > step else "compute"))
    if per_token > 0:
        out["limit_tok_s"] = 1.0 / per_token
        out["limit_share"] = (tokens / decode_s) * per_token
    return out


def limit_text(r: dict) -> str:
    """One line of the figures (`colibri bench`, `--stats`): reads per token, bandwidth, in-RAM step,
    the limit and the share of it reached."""
    if r.get("limit_tok_s") is None:
        return "limit n/a (no decode step timed)"
    step = f"in-RAM step {r['in_ram_step_s'] * 1e3:.2f} ms/token"
    if r["limit_bound"] == "ram":
        head, bound = f"no disk reads while decoding: the limit is the {step}", "all in RAM"
    else:
        bw, disk = r["read_bandwidth_bps"], r["disk_s_per_token"]
        head = (f"read {r['decode_bytes_read_per_token'] / 1e6:.2f} MB/token at "
                f"{'n/a' if bw is None else f'{bw / 1e9:.2f} GB/s'} = "
                f"{'n/a' if disk is None else f'{disk * 1e3:.2f}'} ms/token, {step} "
                f"(+ {r['io_wait_s_per_token'] * 1e3:.2f} ms/token waiting on reads)")
        bound = f"{r['limit_bound']}-bound"
    return f"{head} | limit {r['limit_tok_s']:.2f} tok/s ({bound}), reached {r['limit_share']:.0%}"
