"""The decode step, chosen once at load: which backend runs which layers, and why.

A step is `embed` -> `layers(lo, hi)` over its rows -> `head`; `step` runs the whole of it, `run_steps`
several decode steps at once. Two backends:

- native (engine/native_step.py, kernels/step.c): a range of layers in one C call per step; where the range
  is the whole model and its ends allow (bf16 embedding rows, an f32 final norm, a quantized head), the step
  from token ids to logits in one call, and runs of decode steps in one call. Layers whose experts stream
  from disk run in the same call, which waits there for their reads (engine/stream_hook.py).
- torch: the modules' own `forward` (models/base.py CausalLM.forward is the readable reference): any device
  and dtype. Its blocks call the per-layer native kernels where those take their weights
  (layers/layers.py DecoderBlock), so a layer range that is not native is still far from pure torch.

The backend of each layer range is decided here, once, with the reason recorded (`describe`, logged at load).
Each step's routes come back as values (`take_routes`): the native calls return them, the torch layers leave them
in their experts' `route`, which the plan reads and clears.
A step whose rows the native call does not take (more rows than native.MOE_MAX_ROWS: a prefill chunk; a
cache of another kind; a full context) runs on the torch backend: the same bits where both apply
(tests/test_native_step.py), so the choice changes speed, never output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import native
from ..kernels import native as _kernels  # (`native` is also rebuild's argument)
from ..layers.batch import StepBatch
from ..layers.moe import SwitchGLU
from . import native_step

Routes = Mapping[int, tuple[torch.Tensor, torch.Tensor]]  # MoE layer -> (ids [R, k], weights [R, k])


@dataclass(frozen=True)
class Segment:
    """Layers [lo, hi) and the backend that runs them: what it runs, or why they are not native."""

    lo: int
    hi: int
    backend: str  # "native" | "torch"
    why: str

    def __str__(self) -> str:
        span = f"layer {self.lo}" if self.hi - self.lo == 1 else f"layers {self.lo}-{self.hi - 1}"
        return f"{span} {self.backend} ({self.why})"


class DecodePlan:
    """The decode step of one loaded model (weights bound, tiers placed). `native=False` puts every layer on the
    torch backend; `whole_step=False` keeps the embedding and head out of the native call (tests compare the
    forms bit for bit)."""

    def __init__(self, model: nn.Module, native: bool = True, whole_step: bool = True,
                 held: tuple[int, int] | None = None):
        self.model = model
        self.n_layers = len(model.model.layers)
        # the layers this process runs: all of them with the ends, or a cluster stage's range (colibri/cluster)
        self.held, self.ends = held or (0, self.n_layers), held is None
        self.use_native, self.whole_step = native, whole_step
        # per block, the routed experts whose `route` the torch backend leaves for the plan to read
        self._experts = [[m for m in b.modules() if isinstance(m, SwitchGLU)] for b in model.model.layers]
        self._routes: Routes = {}
        self.rebuild()

    def rebuild(self, native: bool | None = None, whole_step: bool | None = None) -> None:
        """Decide again, from the weights as they are now (a caller that moved or replaced weights calls it: the
        native constants point into the old ones); `native` / `whole_step` as in the constructor, where given."""
        self.use_native = self.use_native if native is None else native
        self.whole_step = self.whole_step if whole_step is None else whole_step
        _kernels.background_wait()  # (the kernels' read-ahead may be reading the old weights)
        self._ranges: dict[tuple[int, int], native_step.NativeLayers | str] = {}
        self._version = self.model.weights_version
        lo, L = self.held
        whole = self._native(lo, L)
        self.tail = None
        if isinstance(whole, str):
            self.segments = [Segment(lo, L, "torch", whole)]
            return
        self.tail = native_step.tail(self.model) if self.whole_step and self.ends else None
        what = ["one call a step"]
        if self.ends:
            what.append("with the embedding and head" if self.tail is not None else
                        "the embedding and head in torch" + ("" if self.whole_step else " (asked)"))
        if whole.cached:
            what.append(f"layers {_ranges(whole.cached)}'s experts stream: the call waits for their reads")
        elif self.tail is not None:
            what.append("runs of decode steps")
        self.segments = [Segment(lo, L, "native", ", ".join(what))]

    def describe(self) -> str:
        """One line: which backend runs which layers and why (`colibri run --log-level info` prints it)."""
        rows = f"; steps over {native.MOE_MAX_ROWS} rows (prefill) torch" if any(
            s.backend == "native" for s in self.segments) else ""
        return "decode plan: " + ", ".join(map(str, self.segments)) + rows

    def _native(self, lo: int, hi: int) -> native_step.NativeLayers | str:
        """The native constants of layers [lo, hi), built on first use, or why they cannot be."""
        got = self._ranges.get((lo, hi))
        if got is None:
            m = self.model
            if not self.use_native:
                got = "asked for torch"
            elif m.model.embed_tokens.out_dtype != torch.bfloat16:
                got = f"{m.model.embed_tokens.out_dtype} compute: the kernels run bf16"
            else:
                got = native_step.build(list(m.model.layers[lo:hi]), lo, whole=(lo, hi) == (0, self.n_layers))
            self._ranges[(lo, hi)] = got
        return got

    def _fresh(self) -> None:
        if self._version != self.model.weights_version:
            self.rebuild()

    # ------------------------------------------------------------------ the step

    def step(self, tokens: torch.Tensor, batch: StepBatch, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [T]: the step's rows (layers/batch.py) -> logits f32 [T, V], or [len(out_rows), V] for just those
        rows (the head is a decode step's biggest matmul: skip rows nobody samples)."""
        self._fresh()
        nat = self._ranges[(0, self.n_layers)]
        if self.tail is not None and not isinstance(nat, str):
            got = native_step.step(nat, self.tail, tokens, batch, out_rows)
            if got is not None:
                self._add(got[1])
                return self.model.finish(got[0])
        return self.step_hidden(tokens, batch, out_rows)[0]

    def step_hidden(self, tokens: torch.Tensor, batch: StepBatch, out_rows: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step`'s logits and the last layer's output h [T, H] of every row (an MTP layer's input: engine/mtp.py):
        the embedding and head in torch around the layers' call (the same bits as the whole step)."""
        h = self.layers(self.model.embed(tokens), batch, 0, self.n_layers)
        return self.head(h, out_rows), h

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step's hidden states [T, H] for token ids [T]."""
        return self.model.embed(tokens)

    def layers(self, h: torch.Tensor, batch: StepBatch, lo: int, hi: int) -> torch.Tensor:
        """Layers [lo, hi) over the step's hidden states h [T, H] -> [T, H] (h may be overwritten): the whole
        model, or one stage's range of it."""
        if not 0 <= lo <= hi <= self.n_layers:
            raise ValueError(f"layers [{lo}, {hi}) outside the model's {self.n_layers}")
        self._fresh()
        nat = self._native(lo, hi) if hi > lo else "empty"
        if not isinstance(nat, str):
            got = native_step.layers(nat, h, batch)
            if got is not None:
                self._add(got[1])
                return got[0]
        blocks, routes = self.model.model.layers, {}
        for i in range(lo, hi):
            h = blocks[i](h, batch.layer(i))
            for ex in self._experts[i]:
                if ex.route is not None:
                    routes[ex.layer], ex.route = ex.route, None
        self._add(routes)
        return h

    def head(self, h: torch.Tensor, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits f32 for the rows `out_rows` of the last layer's output h [T, H] (all rows when None)."""
        return self.model.logits(h if out_rows is None else h[out_rows])

    def run_steps(self, tokens: list[int], batch: StepBatch, n_steps: int, stop: torch.Tensor, sampling=None,
                  uniforms=None, processors=None, logprobs=None) -> tuple | None:
        """Up to n_steps decode steps in one native call (engine/native_step.py `steps`: the arguments and the
        result); None where the plan has no such call (not native, the embedding or head not in it, experts
        streamed) or these rows do not fit it. The routes come back to the caller, which counts them."""
        self._fresh()
        nat = self._ranges[(0, self.n_layers)]
        if self.tail is None or isinstance(nat, str) or nat.cached:
            return None
        return native_step.steps(nat, self.tail, tokens, batch, n_steps, stop, sampling, uniforms, processors,
                                 logprobs)

    def failed(self, e: BaseException) -> bool:
        """A step raised `e`: whether every request in flight lost its state with it (never here; a cluster's plan
        says so when a stage died with its K/V: colibri/cluster/head.py)."""
        return False

    def take_routes(self) -> Routes:
        """The routes of the steps run since the last take (a step's: MoE layer -> (ids [R, k], weights [R, k]))."""
        out, self._routes = self._routes, {}
        return out

    def _add(self, routes: Routes) -> None:
        if not self._routes:
            self._routes = routes
        elif routes:
            self._routes = {**self._routes, **routes}

    def native_layers(self) -> native_step.NativeLayers | None:
        """The whole model's native constants, None where its layers are on the torch backend (introspection)."""
        nat = self._ranges[self.held]
        return None if isinstance(nat, str) else nat


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
