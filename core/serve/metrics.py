"""Prometheus metrics of the server (GET /metrics), in a registry of its own.

    bestiary_requests_total{endpoint, status}    HTTP requests answered
    bestiary_prompt_tokens_total                 prompt tokens of accepted requests
    bestiary_generation_tokens_total             tokens generated
    bestiary_time_to_first_token_seconds         request accepted -> its first token
    bestiary_inter_token_latency_seconds         between two deliveries of one sequence, per token
    bestiary_request_latency_seconds             request accepted -> its last token
    bestiary_requests_waiting                    accepted requests without a first token yet
    bestiary_requests_running                    sequences in the executor's batch
    bestiary_kv_blocks_used / _free / _total     the paged KV pool (free counts cached, unreferenced blocks)
    bestiary_spec_decode_steps_total             speculative verification steps (--speculative only)
    bestiary_spec_decode_draft_tokens_total      draft tokens verified
    bestiary_spec_decode_accepted_tokens_total   draft tokens accepted (rate: accepted / draft)
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's counters, histograms and gauges; KV and batch gauges read the executor at scrape time."""

    def __init__(self, executor) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("bestiary_requests", "HTTP requests answered.", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("bestiary_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("bestiary_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("bestiary_time_to_first_token_seconds", "Request accepted to its first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("bestiary_inter_token_latency_seconds", "Time between tokens of one sequence.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("bestiary_request_latency_seconds", "Request accepted to its last token.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("bestiary_requests_waiting", "Accepted requests without a first token yet.", registry=r)
        self.num_waiting = 0  # the gauge's value, for the server's queue limit
        Gauge("bestiary_requests_running", "Sequences in the executor's batch.",
              registry=r).set_function(lambda: len(executor.running))
        alloc = executor.allocator
        Gauge("bestiary_kv_blocks_used", "KV blocks referenced by sequences.", registry=r).set_function(
            lambda: alloc.num_used)
        Gauge("bestiary_kv_blocks_free", "KV blocks free or cached and unreferenced.", registry=r).set_function(
            lambda: alloc.num_free)
        Gauge("bestiary_kv_blocks_total", "KV blocks in the pool.", registry=r).set_function(lambda: alloc.num_blocks)
        if getattr(executor, "speculator", None) is not None:
            r.register(SpeculativeCollector(executor.speculator.stats))

    def exposition(self) -> bytes:
        """The text format of every metric."""
        return generate_latest(self.registry)


class SpeculativeCollector:
    """The speculator's running totals (core.runtime.speculative.AcceptanceStats) as counters, read at scrape time."""

    FIELDS = (("steps", "Speculative verification steps."), ("draft_tokens", "Draft tokens verified."),
              ("accepted_tokens", "Draft tokens accepted."))

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        values = (self.stats.steps, self.stats.drafted, self.stats.accepted)
        for (name, doc), value in zip(self.FIELDS, values):
            yield CounterMetricFamily(f"bestiary_spec_decode_{name}", doc, value=value)


class RequestTimer:
    """One request's timing: TTFT at its first token, inter-token latency per sequence, latency at the end.

    Counts as waiting from creation until its first token or its end (whichever comes first).
    """

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: dict[int, float] = {}  # sequence index -> time of its last delivery
        self.tokens = 0
        self.ended = False
        metrics.prompt_tokens.inc(prompt_tokens)
        self._waiting(+1)

    def tokens_arrived(self, index: int, count: int) -> None:
        """`count` tokens of sequence `index` were delivered now."""
        if count <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self._waiting(-1)
            self.metrics.ttft.observe(now - self.start)
        previous = self.last.get(index)
        if previous is not None:
            for _ in range(count):
                self.metrics.itl.observe((now - previous) / count)
        self.last[index] = now
        self.tokens += count
        self.metrics.generation_tokens.inc(count)

    def _waiting(self, change: int) -> None:
        self.metrics.num_waiting += change
        self.metrics.waiting.set(self.metrics.num_waiting)

    def done(self) -> None:
        """The request ended (finished, failed or abandoned); later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        if self.first is None:
            self.first = time.perf_counter()
            self._waiting(-1)
        self.metrics.latency.observe(time.perf_counter() - self.start)
