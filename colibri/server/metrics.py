"""Prometheus metrics (prometheus-client, text format at GET /metrics).

Request-level series are recorded by the server as requests end; engine and store figures (slots,
queue, expert cache hit rate, bytes read from disk) are read from `Engine.metrics()` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        try:
            m = self.engine.metrics()
        except Exception:  # noqa: BLE001 - a closed engine (shutting down) has no figures to give
            return
        store = m.get("store", {})
        for name, doc, v in (("slots", "KV slots", m.get("slots", 0)),
                             ("slots_busy", "slots running a request", m.get("busy", 0)),
                             ("queue_length", "requests waiting for a slot", m.get("queued", 0)),
                             ("expert_cache_hit_rate", "expert cache hits / lookups since load",
                              store.get("hit_rate", 0.0) if store.get("lookups") else 0.0),
                             ("batching_gain", "experts summed over requests / experts fetched per step",
                              m.get("batching_gain", 1.0)),
                             ("spec_acceptance_rate", "drafted tokens accepted / drafted tokens verified",
                              m["spec_accepted"] / m["spec_drafted"] if m.get("spec_drafted") else 0.0),
                             ("tokens_per_forward", "generated tokens per decode forward of a request (1: no drafts)",
                              m.get("tokens_per_forward", 1.0))):
            yield GaugeMetricFamily(f"colibri_{name}", doc, value=v)
        for name, doc, v in (("engine_steps", "engine forward steps", m.get("steps", 0)),
                             ("expert_cache_hits", "expert cache hits", store.get("hits", 0)),
                             ("expert_cache_misses", "expert cache misses", store.get("misses", 0)),
                             ("disk_read_bytes", "bytes of expert weights read from disk", store.get("bytes_read", 0)),
                             ("engine_busy_seconds", "time the engine thread spent in steps", m.get("busy_s", 0.0)),
                             ("spec_draft_tokens", "drafted tokens verified (speculative decoding)",
                              m.get("spec_drafted", 0)),
                             ("spec_accepted_tokens", "drafted tokens accepted", m.get("spec_accepted", 0))):
            yield CounterMetricFamily(f"colibri_{name}", doc, value=v)


class Metrics:
    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("colibri_requests", "finished requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("colibri_request_errors", "requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("colibri_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("colibri_prompt_tokens_cached",
                                     "prompt tokens of finished requests whose K/V a slot already held", registry=r)
        self.generation_tokens = Counter("colibri_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("colibri_inter_token_latency_seconds", "time between two tokens of one request",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("colibri_request_duration_seconds", "request arrival to its end",
                             buckets=_LATENCY, registry=r)
        if engine is not None:
            r.register(_EngineCollector(engine))

    def finished(self, endpoint: str, finish_reason: str, prompt_tokens: int, generated: int,
                 ttft_s: float | None, duration_s: float, cached_tokens: int = 0) -> None:
        self.requests.labels(endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(duration_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
