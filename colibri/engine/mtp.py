"""The model's own multi-token-prediction layer as a draft source (`Engine(mtp=True)`, `--spec mtp`).

After each step of a request that drafts with it, the MTP layer (layers/mtp.py) takes the step's kept rows: row i
at position p gives the main model's last-layer output h_p (after its final norm) and the token after it, t_{p+1}
(the next prompt token, an accepted draft, or the token just picked). Its K/V at those positions are written (one
batched forward of every such request's rows, prompt chunks included: a later position attends over all of
them), and its prediction at the last row is the first draft. Further drafts chain the layer on itself: its output
before its norm stands in for h, the draft for the token, one position on (DeepSeek-V3's sequential MTP with the
one shipped layer). A request's drafts stop where the layer's probability of its pick falls below `p_min`.

Rollback is positional: the next write starts at the verify's first rejected position and overwrites what chained
drafts wrote there. `held[slot]` records the tokens t_0..t_n whose entries 0..n-1 the slot's cache holds (checked
against a request's context once, when it first writes to the slot; then extended by its rows); a chunk
whose earlier positions it does not hold (a slot reused with a cached prompt prefix whose MTP entries came from
another continuation) does not draft with the layer. The drafts never change a token: the main model's verify
decides (engine/verify.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ColibriError
from ..layers import mtp
from ..layers.batch import Seq, StepBatch
from ..layers.moe import SwitchGLU
from ..models.base import bind
from ..store import TieredStore
from . import native_step
from .draft import P_MIN
from .kv import common_prefix


@dataclass
class Rows:
    """One request's rows of a step for the MTP layer: positions start..start + len(nexts) - 1, the rows' indices
    in the step's hidden states, the token after each, k drafts wanted after them (0: a prompt chunk that is not the
    last), the request (`rid`) and its context t_0..t_{start + len(nexts)} (`context()`, built only where the slot
    held another request's entries)."""

    slot: int
    start: int
    rows: list[int]
    nexts: list[int]
    k: int
    rid: object
    context: Callable[[], list[int]]


def budget_left(container, mem_budget: int) -> int:
    """The main model's share of `mem_budget` once the MTP layer's weights (kept in RAM) are out of it; a one-line
    refusal where they take it all."""
    from ..store.sizes import human, mtp_bytes

    need = mtp_bytes(container)
    if need >= mem_budget:
        raise ColibriError(f"the MTP layer's weights ({human(need)}) take all of --mem-budget {human(mem_budget)}")
    return mem_budget - need


class MTPHead:
    def __init__(self, container, target: torch.nn.Module, n_slots: int, ctx: int, dtype: torch.dtype):
        """The container's MTP layer 0 beside `target` (the main model: its embedding, final norm and head); a
        one-line refusal where the container has none (`View`)."""
        self.view = mtp.View(container)
        self.model = mtp.build(container.model_type, container.config)
        self.store = TieredStore(self.view, dtype, None, prefetch=False)  # type: ignore[arg-type]
        try:
            bind(self.model, self.store)
            self.store.attach(self.model)
            self.model.eval()
        except BaseException:
            self.store.close()
            raise
        self.blocks = list(self.model.model.layers)  # (one layer; a few where a step runs several: Nemotron-H's)
        # the layers in one native call where the kernels take them (int8/int4 weights, bf16), else their torch forward
        self._nat = native_step.build(self.blocks, 0, whole=False) if dtype == torch.bfloat16 else "f32"
        self._experts = [m for b in self.blocks for m in b.modules() if isinstance(m, SwitchGLU)]
        self.target = target
        self.caches = [self.model.make_cache(ctx, dtype) for _ in range(n_slots)]  # [slot][1]
        self.held: list[list[int]] = [[] for _ in range(n_slots)]  # (module doc)
        self.owner: list[object] = [None] * n_slots  # the request whose rows the slot's entries last took
        self.ctx = ctx
        self.p_min = P_MIN
        self.forwards = 0

    def cached(self, h, slot: int) -> int:
        """Prompt positions request h may take from the slot's cache (engine/scheduler.py `prefix_cap`): all where
        it does not draft with the layer, else those whose MTP entries the slot holds too (the others' hidden
        states are gone: they are computed again)."""
        if h.speculative != "mtp":
            return len(h.prompt_ids)
        return max(common_prefix(self.held[slot], h.prompt_ids) - 1, 0)

    def step(self, hidden: torch.Tensor, asks: list[Rows]) -> list[list[int] | None]:
        """Write the asks' rows of a step's last-layer output hidden [T, H]; per ask its drafts (None: the slot
        does not hold its earlier positions: nothing written)."""
        out: list[list[int] | None] = [None] * len(asks)
        live = [j for j, a in enumerate(asks) if self._holds(a)]
        if not live:
            return out
        idx = torch.from_numpy(np.array([r for j in live for r in asks[j].rows], dtype=np.int64))
        h = self.target.model.norm(hidden[idx])  # [R, H]: the main model's final hidden states
        toks = [t for j in live for t in asks[j].nexts]
        y = self._forward(toks, h, [(asks[j].slot, asks[j].start, len(asks[j].nexts)) for j in live])  # [R, H]
        last, r = {}, 0  # ask -> its last row in y
        for j in live:
            a = asks[j]
            r += len(a.nexts)
            last[j] = r - 1
            held = self.held[a.slot]
            del held[a.start + 1 :]
            held.extend(a.nexts)  # (t_{start + 1}.. : the token after each row)
            self.owner[a.slot] = a.rid
        # drafts: the prediction at each ask's last row, then the layer chained on its own output
        drafts: dict[int, list[int]] = {j: [] for j in live}
        want = {j: min(asks[j].k, self.ctx - 1 - asks[j].start - len(asks[j].nexts)) for j in live}
        go = [j for j in live if want[j] > 0]  # the asks still drafting, in y's row order
        y = y[torch.tensor([last[j] for j in go], dtype=torch.int64)]  # [n, H]
        while go:
            p, pick = torch.softmax(self._logits(y), -1).max(-1)  # [n]
            picks, sure = pick.tolist(), (p >= self.p_min).tolist()
            for j, tok, ok in zip(go, picks, sure):
                if ok:
                    drafts[j].append(tok)
            more = [i for i, (j, ok) in enumerate(zip(go, sure)) if ok and len(drafts[j]) < want[j]]
            go = [go[i] for i in more]
            if go:
                spans = [(asks[j].slot, asks[j].start + len(asks[j].nexts) + len(drafts[j]) - 1, 1) for j in go]
                y = self._forward([drafts[j][-1] for j in go], y[torch.tensor(more, dtype=torch.int64)], spans)
        for j, d in drafts.items():
            out[j] = d
        return out

    def _holds(self, a: Rows) -> bool:
        """Whether the slot holds a's entries before its rows (positions < start): its own earlier rows, or a
        prefix of its context another request wrote."""
        held = self.held[a.slot]
        if a.start == 0:
            held[:] = a.context()[:1]
            return True
        if self.owner[a.slot] is a.rid:
            return len(held) > a.start
        ctx = a.context()
        if common_prefix(held, ctx) <= a.start:
            return False
        del held[a.start + 1 :]
        return True

    def _forward(self, toks: list[int], h: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """The layer over rows (its input from the tokens and h [R, H]: the main model's normed output, or the
        layer's own when chained), spans (slot, start, rows) in row order -> its output [R, H] before its norm."""
        e = self.target.embed(torch.from_numpy(np.array(toks, dtype=np.int64)))  # [R, H]
        seqs, r = [], 0
        for slot, start, n in spans:
            seqs.append(Seq(r, r + n, start, self.caches[slot]))
            r += n
        x, batch = self.model.inputs(e, h), StepBatch(seqs)
        got = None if isinstance(self._nat, str) else native_step.layers(self._nat, x, batch)
        if got is not None:
            y = got[0]
        else:
            y = x
            for i, block in enumerate(self.blocks):
                y = block(y, batch.layer(i))
        for ex in self._experts:  # (nobody counts the MTP layer's routes)
            ex.route = None
        self.forwards += 1
        return y

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        """[n, V] f32: the main model's head after the layer's own norm."""
        return self.target.finish(self.target.lm_head(self.model.model.norm(y)).float())

    def close(self) -> None:
        self.store.close()
