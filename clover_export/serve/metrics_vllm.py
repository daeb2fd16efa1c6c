"""The `vllm:` metric names dashboards and load tools read, beside the server's own (docs/serving.md, vLLM-compatible
metrics).

Names, types and buckets follow vLLM's v1 engine (`vllm/v1/metrics/loggers.py`), every series labelled
`model_name` (the served model's name). Figures come from the same finished requests as `clover_*`'s; what vLLM
counts per token or per scheduled request is counted here per finished request:

- inter-token latency: blocks commit several tokens at once, so per-token gaps do not exist; each of a request's
  n - 1 gaps is observed as its mean gap, (finish - first block) / (n - 1), so the histogram's sum and count
  equal vLLM's (the total decode time, the number of gaps);
- prefix-cache queries and hits: prompt tokens, and prompt tokens resumed from the prefix cache;
- speculative drafts, draft tokens and accepted tokens: `self_spec` verifying forwards with a draft, the tokens
  drafted, the draft tokens accepted (DECODING.md 5).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISHED_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort"}


class VllmMetrics:
    """The compatibility set, in the server's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        r, labels = registry, ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                             registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", labels,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                     "queried tokens.", labels, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                  labels, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                    registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                                       registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r)
        for metric in (self.running, self.waiting, self.ttft, self.itl, self.tpot, self.e2e, self.prompt_tokens,
                       self.generation_tokens, self.cache_queries, self.cache_hits, self.drafts, self.draft_tokens,
                       self.accepted_tokens):
            metric.labels(model_name)  # every series from the start, at zero
        for reason in sorted(set(FINISHED_REASONS.values())):
            self.success.labels(model_name, reason)

    def load(self, running: int, waiting: int) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)

    def finished(self, job, result) -> None:
        """One finished request's figures (`job`: its engine Job, `result`: its runtime Result)."""
        name, now = self.model_name, time.perf_counter()
        self.e2e.labels(name).observe(now - job.submitted)
        if job.first_block is not None:
            self.ttft.labels(name).observe(job.first_block - job.submitted)
            gaps = result.response_tokens - 1
            if gaps > 0:
                mean = (now - job.first_block) / gaps
                self.tpot.labels(name).observe(mean)
                itl = self.itl.labels(name)
                for _ in range(gaps):
                    itl.observe(mean)
        self.prompt_tokens.labels(name).inc(result.prompt_tokens)
        self.generation_tokens.labels(name).inc(result.response_tokens)
        self.cache_queries.labels(name).inc(result.prompt_tokens)
        self.cache_hits.labels(name).inc(result.cached_tokens)
        request = getattr(job.handle, "request", None)  # the runtime's record: its draft counters
        self.drafts.labels(name).inc(getattr(request, "verifications", 0))
        self.draft_tokens.labels(name).inc(getattr(request, "drafted_tokens", 0))
        self.accepted_tokens.labels(name).inc(getattr(request, "accepted_tokens", 0))
        reason = FINISHED_REASONS.get(result.finish_reason)
        if reason is not None:
            self.success.labels(name, reason).inc()
