"""The Python API: `colibri.load(path) -> Engine`."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from . import arena
from .analysis.probe import peak_rss_mib, physical_cores  # noqa: F401 - (colibri.api's own)
from .engine.decode_plan import DecodePlan
from .engine.grammar import GrammarCompiler
from .engine.kv import SlotPool
from .engine.mtp import MTPHead
from .engine.mtp import budget_left as mtp_budget_left
from .engine.request import EngineClosedError, QueueFullError, RequestHandle, RequestStats, SamplingParams, TokenEvent
from .engine.runner import Runner
from .engine.scheduler import Scheduler
from .engine.speculative import DRAFT_MAX
from .engine.speculative import check as check_speculative
from .engine.stats import StepInfo
from .errors import ColibriError, SlotBusyError
from .format.container import Container
from .kernels import native
from .layers.kvquant import KVTypes
from .models.base import bind, build
from .store import Placement, TieredStore
from .store.placement import parse_size
from .store.tiered import PlacementFn, stats_delta
from .tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("colibri")


def compute_dtype_for(scheme: str) -> torch.dtype:
    """f32 containers compute in f32 (the oracle setting); everything else in bf16."""
    return torch.float32 if scheme == "f32" else torch.bfloat16


class _PerThread(threading.local):
    """What the last request of each calling thread left (class attributes: every thread starts from None)."""

    stats: RequestStats | None = None
    message: dict | None = None


class Engine:
    """A loaded model serving requests: tokenizer, weights bound through the tiered store, N KV slots,
    and one engine thread that runs every forward pass (docs/ENGINE.md). Every public method is safe
    to call from any thread; concurrent requests share decode steps (continuous batching).

    Slots and scheduling, keyword-only:
    - `slots`: sequences decoded together, each with a KV cache of `ctx_size` positions
      (`kv_bytes()` = slots x ctx_size x bytes per position).
    - `max_queue`: requests allowed to wait for a slot (`QueueFullError` beyond it).
    - `prefill_chunk`: prompt tokens per step (a long prompt is read in chunks, interleaved
      with the decode steps of the running requests; the last <= 192 prompt rows, and prompts
      joining running streams, go <= 64 rows a step on the native kernels: docs/ENGINE.md).
    - `cache_prompt`: a request reuses the K/V a free slot already holds for the leading tokens
      of its prompt (a chat's earlier turns) and computes only the rest. Off while a route trace
      or the debug routing log runs (they need every token's routing).
    - `route_trace`: path of a routing trace to append to (docs/ROUTING.md).
    - `decode_run_ms`: requests without penalties, biases, grammars or log-probs decode up to this
      long per native call, their tokens handed out a run at a time (docs/DESIGN.md "Native runs");
      0 hands out every token as it is made. Default (None) 50.

    Memory tiers (docs/TIERS.md), all keyword-only:
    - `placement`: a `store.Placement` (per-layer "gpu" / "ram" / "disk", pinned hot experts),
      or a function `(ModelSizes, mem_budget, gpu_budget) -> Placement | None` that plans one.
      None: the planner places the layers from the budgets and the machine's free memory.
    - `mem_budget`: bytes of RAM for weights (dense weights, RAM-layer experts and the expert
      cache of disk layers): an int, or a size as the CLI takes it ("3G", "1500M"). Weights are then
      read into memory the engine owns instead of being mapped. None: no bound (weights are mapped;
      disk layers get a small default cache).
    - `gpu_budget`: bytes (or a size string) of VRAM for the GPU layers' weights; their experts go to a VRAM
      cache when they do not all fit. None: no bound.
    - `prefetch`: predict the next layer's experts with its router (look-ahead) and read them
      while the current layer computes.
    - `direct_io`: read experts with O_DIRECT (falls back to buffered reads where refused).
    - `mmap`: without a `mem_budget`, use the weights as zero-copy views of the file's mapping
      (the fastest start) instead of reading them into engine-owned memory (the default: the
      kernels read those faster, docs/TIERS.md "Loading").
    - `gpu_device`: device of the "gpu" tier (default "cuda"; "cpu" runs the GPU code path on
      the CPU, for tests).
    Greedy output is the same whatever the tiers, budgets, prefetch, I/O settings and batch.

    - `cluster`: run on a Ray cluster ("HOST:PORT" or "auto"; docs/CLUSTER.md): `cluster_mode` "pipeline" (each
      node offering the resource `colibri` holds a range of layers) or "experts" (they hold the routed experts);
      `cluster_stages` of those nodes (default all), each within `mem_budget`; `cluster_timeout`: seconds a step
      may wait for them (default 300).
    - `kv_type`: the KV cache's storage (llama.cpp's -ctk / -ctv): "bf16" (the compute dtype, the default),
      "q8_0" or "q4_0" for K and V both, or a pair (K, V); docs/QUANT.md "The KV cache" has its numerics.
    - `draft_model`: a smaller .coli of the same tokenizer proposing drafts for `speculative="draft"` (and "auto"
      where prompt lookup has no match): engine/draft.py. Its weights stay in RAM, out of `mem_budget`.
    - `mtp`: load the model's multi-token-prediction layer (layers/mtp.py) to draft for `speculative="mtp"`:
      engine/mtp.py. Its weights stay in RAM, out of `mem_budget`.
    """

    def __init__(self, path: str | os.PathLike, ctx_size: int = 4096, threads: int | None = None,
                 dtype: torch.dtype | None = None, verify: bool = False, *, slots: int = 1, max_queue: int = 64,
                 prefill_chunk: int = 512, cache_prompt: bool = True, route_trace: str | os.PathLike | None = None,
                 placement: Placement | PlacementFn | None = None, mem_budget: int | str | None = None,
                 gpu_budget: int | str | None = None, prefetch: bool = True, direct_io: bool = True,
                 gpu_device: str | None = None, cache_policy: str = "reuse", decode_run_ms: float | None = None,
                 mmap: bool = False, kv_type: str | tuple[str, str] | KVTypes | None = None,
                 cluster: str | None = None, cluster_mode: str = "pipeline", cluster_stages: int | None = None,
                 cluster_timeout: float | None = None, draft_model: str | os.PathLike | None = None,
                 mtp: bool = False):
        for name, v, lo in (("ctx_size", ctx_size, 1), ("slots", slots, 1), ("max_queue", max_queue, 0),
                            ("prefill_chunk", prefill_chunk, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ColibriError(f"{name} must be an integer >= {lo}, got {v!r}")
        if decode_run_ms is not None and (isinstance(decode_run_ms, bool) or not isinstance(decode_run_ms, int | float)
                                          or not 0 <= decode_run_ms <= 10_000):
            raise ColibriError(f"decode_run_ms must be a number of milliseconds in 0..10000, got {decode_run_ms!r}")
        mem_budget, gpu_budget = _budget("mem_budget", mem_budget), _budget("gpu_budget", gpu_budget)
        if draft_model is not None and mem_budget is not None:  # (the draft's weights come out of the same budget)
            from .engine.draft import budget_left

            mem_budget = budget_left(draft_model, mem_budget)
        self.kv_types = KVTypes.of(kv_type)
        self._closed = True  # until fully built: close() and __del__ then have nothing to undo
        self.threads = threads or physical_cores()
        # Loading runs on one torch thread: a parallel op here would give this (the caller's) thread an
        # OpenMP team of its own next to the engine thread's, and libgomp then puts every worker to
        # sleep after each parallel region (more threads than cores): the engine's prefill GEMMs ran
        # at half speed. The engine thread sets its own counts (engine/runner.py).
        torch.set_num_threads(1)
        self.container = Container(path, verify=verify)
        c = self.container
        if mtp and mem_budget is not None:  # (the MTP layer's weights come out of the budget too)
            mem_budget = mtp_budget_left(c, mem_budget)
        self.config = c.config
        self.tokenizer = Tokenizer(c.meta.get("tokenizer"), self.config)
        self.scheme = c.quant.get("scheme", "bf16")
        self.dtype = dtype or compute_dtype_for(self.scheme)
        self.model, self.args = build(c.model_type, self.config)
        self.cluster, keep, routed, self._cluster_part = cluster, None, True, None
        if cluster is not None:  # pipeline stages or expert workers on Ray (colibri/cluster, docs/CLUSTER.md)
            from .cluster import attach

            keep, routed, placement = attach.prepare(self.model, cluster_mode)
            cluster_budget, mem_budget = mem_budget, None  # (--mem-budget applies to each node)
        elif placement is None:  # the planner: no tier flags -> place by budgets and free memory
            from .plan import placement_fn

            placement = placement_fn(c, ctx_size * slots, kv_types=self.kv_types)
        self.store = TieredStore(c, self.dtype, placement, mem_budget=mem_budget, gpu_budget=gpu_budget,
                                 prefetch=prefetch, direct_io=direct_io, gpu_device=gpu_device, policy=cache_policy,
                                 mmap=mmap, keep=keep, routed=routed)
        try:
            bind(self.model, self.store)
            self.store.attach(self.model)
            self.model.model.embed_tokens.out_dtype = self.dtype
            self.model.eval()
            self.ctx_size, self.n_slots = ctx_size, slots
            self.vocab_rows = self.model.model.embed_tokens.num_embeddings
            if cluster is not None:
                kv = (self.kv_types.k.label, self.kv_types.v.label)
                self.slots, self.plan, self._cluster_part = attach.start(
                    self, cluster_mode, cluster, cluster_stages, cluster_budget,
                    dict(ctx=ctx_size, slots=slots, dtype=str(self.dtype).removeprefix("torch."), kv=kv,
                         prefetch=prefetch, direct_io=direct_io, cache_policy=cache_policy), cluster_timeout)
            else:
                self.slots = SlotPool(self.model, slots, ctx_size, self.dtype, self.store.layer_device, self.kv_types)
                self.plan = DecodePlan(self.model)  # which backend runs which layers, decided once
            log.info("colibri: %s", self.plan.describe())
        except BaseException:
            self.store.close()
            raise
        # Steps with decoding sequences stay within the native kernels' row limit (engine/scheduler.py):
        # measured in `colibri serve`, 3-7 prompts joining one running stream in one torch-GEMM step took
        # 0.6-1 s to their first token; in steps of <= 64 rows on the native pool, ~0.1 s per step.
        mixed = native.MOE_MAX_ROWS if native.available() else None
        cache_prompt = cache_prompt and self.slots.rewindable  # (linear-attention states: engine/kv.py)
        self._sched = Scheduler(self.slots, max_queue, prefill_chunk, mixed, cache_prompt and route_trace is None)
        self._cache_prompt = cache_prompt
        self._runner = Runner(self.model, self.plan, self._sched, self.store, self.threads,
                              lambda: self.tokenizer.eos_ids)
        self._runner.run_s = None if decode_run_ms is None else decode_run_ms / 1000
        self._draft = self._mtp = None
        if draft_model is not None or mtp:
            self._load_sources(draft_model, mtp)
        if cluster is not None:  # (the experts live on the other nodes)
            self._runner.n_experts = self._cluster_part.n_experts()
        self._grammars = GrammarCompiler(self.tokenizer.tk, self.vocab_rows)
        self._local = _PerThread()
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._runner, self.store, self.container,
                                           self._cluster_part, (self._draft, self._mtp))
        self._trace = self._route_logger = None
        if route_trace is not None:
            from .analysis.trace import RouteTraceWriter

            self._trace = RouteTraceWriter(route_trace, self.tokenizer, experts=self._runner.n_experts, model=str(path))
            self.add_step_listener(self._trace)

    # ------------------------------------------------------------------ facts

    def _load_sources(self, path, mtp: bool) -> None:
        """The draft model (engine/draft.py) and MTP layer (engine/mtp.py) the runner's speculator proposes from."""
        from .engine.draft import DraftModel

        spec = self._runner.spec
        try:
            if self.cluster is not None:
                raise ColibriError("a draft model or MTP layer runs on one machine: --draft-model and --spec mtp do "
                                   "not combine with --cluster")
            if path is not None:
                self._draft = spec.drafter = DraftModel(path, self.n_slots, self.ctx_size,
                                                        self.tokenizer.tk.get_vocab(), compute_dtype_for)
            if mtp and self.store.placement.layers("gpu"):
                raise ColibriError("the MTP layer runs on the CPU: --spec mtp does not combine with GPU layers yet")
            if mtp:
                self._mtp = spec.mtp = MTPHead(self.container, self.model, self.n_slots, self.ctx_size, self.dtype)
                self._sched.prefix_cap = self._mtp.cached
        except BaseException:
            _shutdown(self._runner, self.store, self.container, None, (self._draft,))
            raise

    @property
    def n_layers(self) -> int:
        return len(self.model.model.layers)

    @property
    def caches(self) -> list:
        """Slot 0's per-layer caches (introspection; a caller may write into them, so the slot's
        prompt cache is dropped)."""
        self.slots.forget(0)
        return self.slots.caches[0]

    def kv_bytes(self) -> int:
        """Bytes of all KV slots: slots x ctx_size x bytes per position."""
        return self.slots.nbytes

    @property
    def last_stats(self) -> RequestStats:
        """Stats of the last request this thread ran through generate / generate_ids."""
        return self._local.stats or RequestStats()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed; load the model again to use it")

    # ------------------------------------------------------------------ requests

    # The defaults of submit's `speculative` and `draft_max` (the CLI's --spec and --draft-max set them).
    speculative: str = "auto"  # (its gate drafts where measured costs say it pays: docs/ENGINE.md)
    draft_max: int = DRAFT_MAX

    def submit(self, prompt_ids: list[int], max_tokens: int = 256, *, sampling: SamplingParams | None = None,
               stop_ids: tuple[int, ...] | frozenset[int] = (), ignore_eos: bool = False,
               prompt_logprobs: int | None = None, request_id: str | None = None,
               listener: Callable[[TokenEvent | None], None] | None = None, _want_logits: bool = False,
               speculative: str | None = None, draft_max: int | None = None, **sampling_kw) -> RequestHandle:
        """Queue a request; returns its handle at once (iterate it for tokens, `cancel()` to stop it).

        `listener`: registered before the request is queued, so it sees every event (see
        `RequestHandle.add_listener`). `speculative`: "auto" (the default), "lookup", "draft", "mtp" or "off"
        (docs/ENGINE.md, "Speculative decoding": the same greedy tokens, the same sampling distribution either way);
        `draft_max`: drafts per verify at most (None: the engine's `speculative` / `draft_max`). Raises
        `QueueFullError` when `max_queue` requests already wait, `ColibriError` for bad input."""
        self._check_open()
        speculative = self.speculative if speculative is None else speculative
        draft_max = self.draft_max if draft_max is None else draft_max
        check_speculative(speculative, draft_max, self._draft is not None, self._mtp is not None)
        if sampling is None:
            try:
                sampling = SamplingParams(**sampling_kw)
            except TypeError as e:
                raise ColibriError(f"unknown sampling setting: {e}") from None
        elif sampling_kw:
            raise ColibriError("give either sampling= or sampling keywords, not both")
        sampling.validate()
        if sampling.logit_bias and max(sampling.logit_bias) >= self.vocab_rows:
            raise ColibriError(f"logit_bias: token id {max(sampling.logit_bias)} is beyond the vocabulary "
                               f"({self.vocab_rows} ids)")
        ids = self._check_prompt(prompt_ids)
        constraint = None
        if sampling.grammar is not None:  # compiled here, in the caller's thread: a bad grammar is its error
            constraint = self._grammars.constraint(sampling.grammar, frozenset(stop_ids) | self.tokenizer.eos_ids)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ColibriError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        if len(ids) > self.ctx_size or (max_tokens > 0 and len(ids) >= self.ctx_size):
            raise ColibriError(f"the prompt has {len(ids)} tokens, which does not fit ctx-size {self.ctx_size} "
                               "(raise --ctx-size or shorten the prompt)")
        if prompt_logprobs is not None and (isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int)
                                            or not 0 <= prompt_logprobs <= 20):
            raise ColibriError(f"prompt_logprobs must be an integer in [0, 20], got {prompt_logprobs!r}")
        h = RequestHandle(ids, max_tokens, sampling, stop_ids=frozenset(stop_ids), ignore_eos=ignore_eos,
                          prompt_logprobs=prompt_logprobs, want_logits=_want_logits, request_id=request_id,
                          constraint=constraint, speculative=speculative, draft_max=draft_max)
        if listener is not None:
            h.add_listener(listener)
        self._sched.submit(h)
        self._runner.counters.requests += 1
        self._runner.counters.prompt_tokens += len(ids)
        return h

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.reshape(-1).tolist()
        try:
            ids = [int(i) for i in prompt_ids]
        except (TypeError, ValueError):
            raise ColibriError("the prompt must be a list of token ids (integers)") from None
        if any(isinstance(i, bool) or (isinstance(i, float) and not float(i).is_integer()) for i in prompt_ids):
            raise ColibriError("the prompt must be a list of token ids (integers)")
        if not ids:
            raise ColibriError("the prompt is empty (no tokens)")
        bad = next((i for i in ids if not 0 <= i < self.vocab_rows), None)
        if bad is not None:
            raise ColibriError(f"token id {bad} is out of range: the vocabulary has {self.vocab_rows} entries")
        return ids

    def generate_ids(self, prompt_ids: list[int], max_tokens: int = 256, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, repeat_penalty: float = 1.0, seed: int | None = None,
                     ignore_eos: bool = False, **kw) -> Iterator[int]:
        """Yield generated token ids (EOS ends the stream and is not yielded); stats land in `last_stats`.
        Closing the iterator early cancels the request."""
        before = self.store.stats()
        h = self.submit(prompt_ids, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        repeat_penalty=repeat_penalty, seed=seed, ignore_eos=ignore_eos, **kw)
        try:
            for ev in h:
                yield ev.token
        finally:
            if not h.done:
                h.cancel()
                self._sched.wake()
                h._done.wait(10)  # the engine ends it at its next step; then its stats are final
            h.stats.extra["peak_rss_mib"] = peak_rss_mib()
            h.stats.extra["huge_pages_mib"] = arena.huge_pages_mib()
            if not self._closed:
                h.stats.extra["store"] = stats_delta(before, self.store.stats())
            self._local.stats = h.stats

    def generate(self, prompt: str, max_tokens: int = 256, *, add_special_tokens: bool = True, **kw) -> Iterator[str]:
        """Yield text pieces as they are generated (the prompt itself is not echoed).

        A prompt rendered by `tokenizer.apply_chat_template` already holds its special tokens:
        pass `add_special_tokens=False` for it (as transformers does)."""
        self._check_open()
        if not isinstance(prompt, str):
            raise ColibriError(f"the prompt must be a string, got {type(prompt).__name__} (token ids: generate_ids)")
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        dec = StreamDecoder(self.tokenizer)
        for tok in self.generate_ids(ids, max_tokens, **kw):
            if piece := dec.push(tok):
                yield piece
        if rest := dec.flush():
            yield rest

    def chat(self, messages: list[dict], max_tokens: int = 256, *, tools: list[dict] | None = None,
             template_kwargs: dict | None = None, **kw) -> Iterator[str]:
        """Yield the assistant's answer to `messages` ([{"role", "content"}, ...]) as it is generated:
        the model's chat template (with `tools`, OpenAI's function dicts, and extra variables such as
        `enable_thinking`), its stop tokens, then `generate`'s sampling keywords.

        Yields the answer only: a thinking model's reasoning (`<think>`, gpt-oss's analysis channel) and
        the tool calls the model writes in its family's format are split off as the server does
        (colibri/server/answer.py) and land in `last_message` when the answer is complete."""
        from .server.answer import keep_ids, splitter
        from .server.reasoning import opens_thinking
        from .server.tool_formats import detect

        self._check_open()
        template = self.tokenizer.template()
        extra = {"tools": tools} if tools else {}
        prompt = template.render(messages, True, **extra, **(template_kwargs or {}))
        stops = frozenset(kw.pop("stop_ids", ())) | (frozenset() if kw.get("ignore_eos") else template.stop_ids)
        fmt = detect(template.source)
        schemas = {f["name"]: f.get("parameters") or {} for t in tools or [] if isinstance(t, dict)
                   and isinstance(f := t.get("function", t), dict) and isinstance(f.get("name"), str)}
        split = splitter(fmt, schemas if tools else None, True, opens_thinking(prompt), True)
        dec = StreamDecoder(self.tokenizer, keep_ids(self.tokenizer, fmt))
        self._local.message = None
        reasoning, content = [], []
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        for tok in self.generate_ids(ids, max_tokens, stop_ids=stops, **kw):
            if piece := dec.push(tok):
                r, c = split.push(piece)
                reasoning.append(r)
                if c:
                    content.append(c)
                    yield c
        r, c = split.push(dec.flush())
        r2, c2, calls = split.finish()
        reasoning += [r, r2]
        if rest := c + c2:
            content.append(rest)
            yield rest
        text = "".join(content)
        self._local.message = {"role": "assistant", "content": (text.strip() or None) if calls else text,
                               "reasoning_content": "".join(reasoning) or None, "tool_calls": calls or None}

    @property
    def last_message(self) -> dict | None:
        """The assistant message of the last `chat()` this thread ran to its end, as OpenAI's chat answer
        has it: content, reasoning_content, tool_calls (None when absent)."""
        return self._local.message

    def generate_batch(self, prompts: list[str], max_tokens: int = 256, *, add_special_tokens: bool = True,
                       **sampling) -> list[str]:
        """Run several prompts concurrently (they share decode steps); their texts, in order."""
        self._check_open()
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise ColibriError("generate_batch takes a list of prompt strings")
        ids = [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
        handles = self._submit_all([dict(prompt_ids=i, max_tokens=max_tokens, **sampling) for i in ids])
        return [self.tokenizer.decode(h.wait()) for h in handles]

    def _submit_all(self, requests: list[dict]) -> list[RequestHandle]:
        """Submit in order; when the queue is full, wait for the oldest unfinished request first."""
        handles: list[RequestHandle] = []
        try:
            for kw in requests:
                while True:
                    try:
                        handles.append(self.submit(**kw))
                        break
                    except QueueFullError:
                        next(h for h in handles if not h.done)._done.wait()
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    def logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [T, vocab] (f32) for `token_ids`, from an empty slot."""
        return self.logits_batch([token_ids])[0]

    def logits_batch(self, windows: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits [T_i, vocab] for each window; windows share steps (one slot each)."""
        self._check_open()
        handles = self._submit_all([dict(prompt_ids=w, max_tokens=0, _want_logits=True) for w in windows])
        for h in handles:
            h.wait()
        return [h.logits for h in handles]

    # ------------------------------------------------------------------ watching

    def health(self) -> dict:
        """Slots busy/free and queue length."""
        self._check_open()
        return {**self._sched.counts(), **(self._cluster_part.health() if self.cluster else {})}

    def metrics(self) -> dict:
        """Engine counters (requests, tokens, steps, batching gain) and the store's (hit rate, bytes read)."""
        self._check_open()
        k = self._runner.counters
        out = {"requests": k.requests, "finished": dict(self._sched.finished), "prompt_tokens": k.prompt_tokens,
               "generated_tokens": k.generated_tokens, "steps": k.steps, "rows": k.rows,
               "decode_rows": k.decode_rows, "experts_unique": k.experts_unique,
               "experts_summed": k.experts_summed, "busy_s": k.busy_s,
               "batching_gain": k.experts_summed / k.experts_unique if k.experts_unique else 1.0,
               "prompt_tokens_cached": self._sched.cached_tokens, "prompt_positions_copied": self.slots.copied}
        spec = self._runner.spec  # drafts verified and accepted; tokens per decode forward (1 + accepted / forwards)
        out.update(spec_drafted=spec.drafted, spec_accepted=spec.accepted, decode_forwards=spec.forwards,
                   tokens_per_forward=1 + spec.accepted / spec.forwards if spec.forwards else 1.0)
        out.update(self._sched.counts())
        out["store"] = self.store.stats()
        if self.cluster:
            out["cluster"] = self._cluster_part.counters()
        return out

    def store_stats(self) -> dict:
        """The weight store's cumulative counters (expert cache hits/misses, bytes read, prefetch
        precision/recall, resident bytes, ...); keys in docs/TIERS.md."""
        self._check_open()
        return self.store.stats()

    def add_step_listener(self, fn: Callable[[StepInfo], None]) -> None:
        """Call `fn(StepInfo)` on the engine thread after every step (keep it quick)."""
        self._check_open()
        self._runner.listeners.append(fn)

    def remove_step_listener(self, fn: Callable[[StepInfo], None]) -> None:
        if fn in self._runner.listeners:
            self._runner.listeners.remove(fn)

    def save_prompt_cache(self, path: str | os.PathLike, slot: int = 0) -> int:
        """Write a free slot's token ids and their K/V to `path` (engine/kvfile.py); returns the positions
        written. `load_prompt_cache` in a later run lets a prompt that starts the same skip that part."""
        if self.cluster:
            raise ColibriError("prompt cache files are not available on a cluster yet: the K/V live on its stages")
        from .engine import kvfile

        with self._idle_slot(slot):
            return kvfile.save(self.slots, slot, path, kvfile.model_identity(self.container.header, self.dtype))

    def load_prompt_cache(self, path: str | os.PathLike, slot: int = 0) -> int:
        """Fill a free slot from a file of `save_prompt_cache` (same model and dtype, else ColibriError);
        returns the positions loaded."""
        if self.cluster:
            raise ColibriError("prompt cache files are not available on a cluster yet: the K/V live on its stages")
        from .engine import kvfile

        with self._idle_slot(slot):
            try:
                return kvfile.load(self.slots, slot, path, kvfile.model_identity(self.container.header, self.dtype))
            except BaseException:
                self.slots.forget(slot)  # partly overwritten, or never known
                raise

    def erase_prompt_cache(self, slot: int = 0) -> int:
        """Forget what a free slot holds (its next request computes its whole prompt); returns the
        positions it held."""
        with self._idle_slot(slot):
            held = len(self.slots.tokens[slot])
            self.slots.forget(slot)
            return held

    def slot_states(self) -> list[dict]:
        """Per slot: `id`, `busy`, the `request_id` it serves (None when free) and `n_cached`, the
        positions whose K/V it holds (what a prompt starting with those tokens would skip)."""
        self._check_open()
        with self._sched.cond:
            serving = {a.slot: a.h.id for a in list(self._sched.active)}
            return [{"id": i, "busy": not self.slots.is_free(i), "request_id": serving.get(i),
                     "n_cached": len(self.slots.tokens[i])} for i in range(self.n_slots)]

    @contextlib.contextmanager
    def _idle_slot(self, slot: int):
        """Hold the scheduler (no admission meanwhile) while a slot no request holds is read or written."""
        self._check_open()
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise ColibriError(f"slot must be an integer in [0, {self.n_slots}), got {slot!r}")
        with self._sched.cond:
            if not self.slots.is_free(slot):
                raise SlotBusyError(f"slot {slot} is serving a request; save or load its cache when it is free")
            yield

    def trace_routing(self, enabled: bool = True) -> None:
        """Log every token's experts and routing weights per layer (debug level; docs/ROUTING.md)."""
        from .analysis.routelog import RouteLogger

        if enabled and self._route_logger is None:
            self._route_logger = RouteLogger(self.tokenizer)
            self.add_step_listener(self._route_logger)
        elif not enabled and self._route_logger is not None:
            self.remove_step_listener(self._route_logger)
            self._route_logger = None
        # Every prompt token's routing is logged only if every prompt token is computed.
        self._sched.cache_prompt = self._cache_prompt and not enabled and self._trace is None

    def close(self) -> None:
        """Cancel what is running, stop the engine thread, release the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        if self._trace is not None:
            self._trace.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(runner: Runner, store: TieredStore, container: Container, cluster_part=None, sources=()) -> None:
    runner.close()
    for src in sources:  # (a draft model, the MTP layer)
        if src is not None:
            src.close()
    if cluster_part is not None:  # a cluster's stages or expert workers
        cluster_part.close()
    native.background_wait()  # (its read-ahead of the weights, before the file goes)
    store.close()
    container.close()


def load(path: str | os.PathLike, ctx_size: int = 4096, threads: int | None = None, **kw) -> Engine:
    """Open a .coli container and return a ready `Engine`.

    `llm = colibri.load("m.coli", ctx_size=2048, threads=2, slots=4)`;
    `for piece in llm.generate("Hello", max_tokens=32, temperature=0): print(piece, end="")`;
    `llm.generate_batch(["a", "b"], max_tokens=16)`; `h = llm.submit(ids, 32)` for a cancellable handle.
    """
    return Engine(path, ctx_size=ctx_size, threads=threads, **kw)


def _budget(name: str, v: int | str | None) -> int | None:
    """A memory budget in bytes: None, an int, or a size string as the CLI's flags take ("3G", "1500M")."""
    if v is None:
        return None
    if isinstance(v, str):
        return parse_size(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ColibriError(f"{name} must be a number of bytes (an int >= 0) or a size such as '3G', got {v!r}")
    return v
