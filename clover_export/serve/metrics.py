"""Prometheus figures of one server (SERVING.md 1 `/metrics`), in the app's own registry.

Per request: status, time to first block, end-to-end latency, tokens, and
the dLLM figures (denoise steps, tokens per forward, distinct experts per
block, DECODING.md 4), prompt tokens resumed from the prefix cache; per
finished request its decoding mode (a label of the validated modes only) and,
for a drafting mode (self_spec), the draft tokens accepted per verifying forward (DECODING.md 5). Per
engine step: step time, running rows, queue depth. At each scrape: the
prefix cache's hit rate and bytes (docs/prefix_cache.md), the C heap in use and kept free (core/heap.py).
Beside them, the `vllm:` names dashboards read (metrics_vllm.py).
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from clover_export.runtime import decoding as modes
from clover_export.serve import adapter
from clover_export.serve.metrics_vllm import VllmMetrics

PREFIX = "clover_"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str):  # the served model's name: the vllm: series' label
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "HTTP generation requests by endpoint (the route's template, or "
                                "'unmatched') and status",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "requests waiting for a slot", registry=r)
        self.running_rows = Gauge(PREFIX + "running_rows", "requests holding a slot in the batch", registry=r)
        self.time_to_first_block = Histogram(PREFIX + "time_to_first_block_seconds",
                                             "submit to first committed block", buckets=_LATENCY, registry=r)
        self.latency = Histogram(PREFIX + "request_latency_seconds", "submit to finish", buckets=_LATENCY,
                                 registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "response tokens of finished requests",
                                        registry=r)
        self.denoise_steps = Counter(PREFIX + "denoise_steps", "denoise steps of finished requests", registry=r)
        self.tokens_per_forward = Histogram(PREFIX + "tokens_per_forward", "response tokens per forward",
                                            buckets=(0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.decoding = Counter(PREFIX + "decoding_requests", "finished generation requests by decoding mode",
                                ["decoding"], registry=r)
        for mode in modes.MODES:  # every series from the start, and no others
            self.decoding.labels(mode)
        self.accepted_per_forward = Histogram(PREFIX + "accepted_per_forward",
                                              "self_spec: mean draft tokens accepted per verifying forward, per "
                                              "finished request", buckets=(0, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32),
                                              registry=r)
        self.distinct_experts = Histogram(PREFIX + "distinct_experts_per_block",
                                          "mean kept-set size per denoise step (coreset)",
                                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.step_time = Histogram(PREFIX + "step_seconds", "engine step time", buckets=_LATENCY, registry=r)
        self.cached_tokens = Counter(PREFIX + "prompt_tokens_cached",
                                     "prompt tokens of finished requests resumed from the prefix cache", registry=r)
        self.cache_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate",
                                    "prompt tokens resumed from the prefix cache / prompt tokens of placed requests, "
                                    "since start", registry=r)
        self.cache_bytes = Gauge(PREFIX + "prefix_cache_bytes",
                                 "prefix cache: snapshots (memory beyond the pools, within the budget) and parked "
                                 "(K/V rows and GDN states of finished sequences kept in idle slots)", ["kind"],
                                 registry=r)
        self.cache_budget = Gauge(PREFIX + "prefix_cache_budget_bytes", "prefix cache snapshot budget", registry=r)
        self.heap_bytes = Gauge(PREFIX + "heap_bytes", "the engine process's C heap (glibc): in_use by live "
                                "allocations, free kept by the allocator for reuse (core/heap.py)", ["state"],
                                registry=r)
        self.vllm = VllmMetrics(r, model_name)

    def step(self, seconds: float, running: int, waiting: int) -> None:
        self.step_time.observe(seconds)
        self.load(running, waiting)

    def load(self, running: int, waiting: int) -> None:
        """Rows in the batch and requests waiting for one, now."""
        self.running_rows.set(running)
        self.queue_depth.set(waiting)
        self.vllm.load(running, waiting)

    def finished(self, endpoint: str, status: int, job=None, result=None, decoding: str | None = None) -> None:
        """One answered request; with its job and Result (status 200), its figures. `decoding`: the mode it
        ran with, one of the registered modes (validated before the engine took it)."""
        self.requests.labels(endpoint, str(status)).inc()
        if job is None or result is None:
            return
        decoding = getattr(result, "decoding", None) or decoding
        strategy = modes.STRATEGIES.get(decoding)
        if strategy is not None:
            self.decoding.labels(decoding).inc()
        if strategy is not None and strategy.drafts:
            self.accepted_per_forward.observe(getattr(result, "accepted_per_forward", 0.0))
        if job.first_block is not None:
            self.time_to_first_block.observe(job.first_block - job.submitted)
        self.latency.observe(time.perf_counter() - job.submitted)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.generated_tokens.inc(result.response_tokens)
        self.denoise_steps.inc(result.denoise_steps)
        if adapter.forwards(result):
            self.tokens_per_forward.observe(result.tokens_per_forward)
        if result.denoise_steps:
            self.distinct_experts.observe(result.distinct_experts_per_block)
        self.vllm.finished(job, result)

    def cache(self, figures: dict[str, float] | None) -> None:
        """The prefix cache's figures now (`PrefixCache.figures`; None when it is off)."""
        figures = figures or {}
        self.cache_hit_rate.set(figures.get("hit_rate", 0.0))
        self.cache_bytes.labels("snapshots").set(figures.get("snapshot_bytes", 0))
        self.cache_bytes.labels("parked").set(figures.get("parked_bytes", 0))
        self.cache_budget.set(figures.get("budget_bytes", 0))

    def heap(self, figures: dict[str, int] | None) -> None:
        """The engine process's C heap now (`heap.heap_bytes`): in use and kept free (absent without glibc)."""
        for state, value in (figures or {}).items():
            self.heap_bytes.labels(state).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
