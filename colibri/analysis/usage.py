"""The learned hot set: per-layer expert routing counts kept across runs (`--usage-file PATH`).

Routing in real MoE models is skewed and stable per workload, so experts that were hot in past
runs are worth pinning in memory before the first token. `Recorder` counts, for every MoE
layer, how often each expert was routed to (prefill and decode tokens alike); `Usage.save`
merges the counts into the file under a lock and replaces it atomically, so concurrent runs
add up instead of overwriting each other and a crash never leaves a half-written file.

File (JSON):
    {"format": "colibri-usage", "version": 1, "experts": [E per layer, 0 for dense layers],
     "tokens": {"layer": routed tokens}, "counts": {"layer": [count per expert]}}
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

import torch

from ..errors import ColibriError

FORMAT, VERSION = "colibri-usage", 1


class Usage:
    """Routing counts of one model: `counts[layer][expert]`, `tokens[layer]` routed tokens."""

    def __init__(self, experts: list[int], path: str | os.PathLike[str] | None = None):
        self.experts = list(experts)
        self.path = os.fspath(path) if path is not None else None
        self.counts: dict[int, list[int]] = {i: [0] * e for i, e in enumerate(self.experts) if e}
        self.tokens: dict[int, int] = {i: 0 for i in self.counts}

    # ------------------------------------------------------------------ queries

    def total_tokens(self) -> int:
        return max(self.tokens.values(), default=0)

    def prob(self, layer: int, expert: int) -> float:
        """P(expert is among a token's routed experts in `layer`); sums to top_k over experts."""
        t = self.tokens.get(layer, 0)
        return self.counts[layer][expert] / t if t else 0.0

    def hottest(self, layer: int, n: int | None = None) -> list[int]:
        """Experts of `layer`, most routed first (ties: lower id first); never-routed ones left out."""
        c = self.counts.get(layer, [])
        order = sorted((e for e in range(len(c)) if c[e]), key=lambda e: (-c[e], e))
        return order if n is None else order[:n]

    def hit_rate(self, layer: int, kept: list[int]) -> float:
        """Share of `layer`'s routings that land on the experts in `kept`."""
        c = self.counts.get(layer, [])
        total = sum(c)
        return sum(c[e] for e in kept) / total if total else 0.0

    def pinned(self, slots: dict[int, int]) -> dict[int, list[int]]:
        """Placement.pinned: per layer, its `slots[layer]` hottest experts, hottest first."""
        return {i: self.hottest(i, n) for i, n in slots.items() if n > 0 and i in self.counts}

    # ------------------------------------------------------------------ file

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "experts": self.experts,
                "tokens": {str(i): t for i, t in self.tokens.items()},
                "counts": {str(i): c for i, c in self.counts.items()}}

    @classmethod
    def from_json(cls, d: dict, path: str | None = None) -> Usage:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ColibriError(f"{path}: not a colibri usage file")
        if d.get("version") != VERSION:
            raise ColibriError(f"{path}: usage file version {d.get('version')} is not supported ({VERSION})")
        try:
            u = cls([int(e) for e in d["experts"]], path)
            for k, c in d["counts"].items():
                i = int(k)
                if len(c) != u.experts[i] or any(not isinstance(x, int) or x < 0 for x in c):
                    raise ValueError(f"layer {i}: bad counts")
                u.counts[i] = list(c)
            for k, t in d["tokens"].items():
                u.tokens[int(k)] = int(t)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise ColibriError(f"{path}: corrupt usage file ({e})") from None
        return u

    @classmethod
    def load(cls, path: str | os.PathLike[str], experts: list[int]) -> Usage:
        """The file's counts, or empty counts if it does not exist yet; refuses another model's file."""
        p = Path(path)
        if not p.exists():
            return cls(experts, p)
        try:
            u = cls.from_json(json.loads(p.read_text()), os.fspath(p))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ColibriError(f"cannot read usage file {p}: {e}") from None
        if u.experts != list(experts):
            raise ColibriError(f"usage file {p} was recorded for another model ({_shape(u.experts)}; this "
                               f"one has {_shape(experts)}): use a separate --usage-file per model")
        return u

    def merge(self, other: Usage) -> None:
        if other.experts != self.experts:
            raise ColibriError("cannot merge usage counts of different models")
        for i, c in other.counts.items():
            self.counts[i] = [a + b for a, b in zip(self.counts[i], c)]
            self.tokens[i] += other.tokens[i]

    def save(self, path: str | os.PathLike[str] | None = None) -> Usage:
        """Add these counts to the file's (under a lock), replace it atomically; returns the merged total."""
        p = Path(path or self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        # The lock file, not the data file, is locked: os.replace swaps the data file's inode.
        with open(p.with_name(p.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            total = Usage.load(p, self.experts)
            total.merge(self)
            tmp = p.with_name(f"{p.name}.tmp-{os.getpid()}")
            try:
                with open(tmp, "w") as f:
                    json.dump(total.to_json(), f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        return total


def _shape(experts: list[int]) -> str:
    moe = [e for e in experts if e]
    return f"{len(experts)} layers, {max(moe, default=0)} experts in {len(moe)}"


class Recorder:
    """Counts routing decisions from the engine's steps (a step listener: the routes each step returns).

    Counting is a bincount per layer per step into one [L, E] tensor: microseconds per token. A listener sees
    every token's routes, the last generated one's too (the engine runs it for listeners).
    """

    def __init__(self, llm):
        from ..layers.moe import SwitchGLU

        self.llm = llm
        model = llm.model
        # All decoder layers, so the list lines up with the planner's (dense layers count 0 experts).
        n_layers = len(model.model.layers)
        self.experts = [0] * n_layers
        for m in model.modules():
            if isinstance(m, SwitchGLU):
                self.experts[m.layer] = m.num_experts
        self.acc = torch.zeros(n_layers, max(self.experts, default=0) or 1, dtype=torch.long)
        self.tok = torch.zeros(n_layers, dtype=torch.long)
        llm.add_step_listener(self)

    def __call__(self, info) -> None:  # engine/stats.py StepInfo
        for layer, (idx, _) in info.routes.items():
            self.acc[layer] += torch.bincount(idx.reshape(-1), minlength=self.acc.shape[1])
            self.tok[layer] += idx.shape[0]

    def usage(self) -> Usage:
        u = Usage(self.experts)
        for i in u.counts:
            u.counts[i] = self.acc[i, : self.experts[i]].tolist()
            u.tokens[i] = int(self.tok[i])
        return u

    def detach(self) -> None:
        self.llm.remove_step_listener(self)
