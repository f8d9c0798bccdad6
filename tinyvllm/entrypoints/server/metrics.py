"""Prometheus metrics with vLLM's names under a `tinyvllm:` prefix.

Gauges and the engine's counters are read at scrape time from the engine thread's snapshot (a
custom collector); token counters and latency histograms are fed by the front as outputs arrive.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tinyvllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Gauges and counters read from `AsyncEngine.state` when /metrics is scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.state
        for name, doc, value in (
                ("num_requests_running", "Sequences in the running batch.", s["num_running"]),
                ("num_requests_waiting", "Sequences waiting for a seat.", s["num_waiting"]),
                ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                 s["kv_cache_usage_perc"]),
                ("num_free_blocks", "KV-cache blocks free in the pool.", s["num_free_blocks"]),
                ("num_blocks", "KV-cache blocks in the pool.", s["num_blocks"])):
            yield GaugeMetricFamily(f"tinyvllm:{name}", doc, value=value)
        for name, doc, value in (
                ("num_preemptions", "Sequences preempted since start.", s["num_preemptions"]),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s["prefix_cache_queries"]),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_cache_hits"]),
                ("kv_offload_loaded_blocks", "KV blocks a KV connector loaded from its tier.",
                 s["kv_offload_loaded_blocks"]),
                ("kv_offload_saved_blocks", "KV blocks a KV connector saved to its tier.", s["kv_offload_saved_blocks"])):
            yield CounterMetricFamily(f"tinyvllm:{name}", doc, value=value)


class ServerMetrics:
    """The server's registry: per-request counters and histograms, plus the engine's state."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter("tinyvllm:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("tinyvllm:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("tinyvllm:request_success", "Requests finished, by reason.",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("tinyvllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tinyvllm:inter_token_latency_seconds", "Time between two tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tinyvllm:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS + (160.0, 320.0), registry=r)
        self._last: dict[str, tuple[float, int]] = {}   # request id -> (time, tokens so far)
        self._open: set[str] = set()                    # requests started, not yet finished or aborted

    def on_start(self, request_id: str) -> None:
        self._open.add(request_id)

    def on_output(self, out: RequestOutput) -> None:
        """Record one output of a request as it reaches the front."""
        now = time.perf_counter()
        n = sum(len(c.token_ids) for c in out.outputs)
        seen = self._last.get(out.request_id)
        if seen is None:
            if n and out.metrics is not None:
                self.ttft.observe(now - out.metrics.arrival_time)
        elif n > seen[1]:
            self.itl.observe((now - seen[0]) / (n - seen[1]))
        if n:
            self.generation_tokens.inc(n - (seen[1] if seen else 0))
            self._last[out.request_id] = (now, n)
        if out.finished:
            self._last.pop(out.request_id, None)
            self._open.discard(out.request_id)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                self.requests.labels(finished_reason=c.finish_reason or "abort").inc()
            if out.metrics is not None:
                self.e2e.observe(now - out.metrics.arrival_time)

    def on_abort(self, request_id: str) -> None:
        """A request that ended unfinished (its client went away, or its step failed): counted
        with finished_reason "abort", and forgotten. A request finished or aborted already is
        left alone, so a handler may call it on every request it started."""
        self._last.pop(request_id, None)
        if request_id in self._open:
            self._open.discard(request_id)
            self.requests.labels(finished_reason="abort").inc()

    def forget(self, request_id: str) -> None:
        """A request refused before it ran (bad input, a full queue): not counted at all."""
        self._last.pop(request_id, None)
        self._open.discard(request_id)

    @property
    def num_open(self) -> int:
        """Requests the metrics still follow (none once every request has ended)."""
        return len(self._open)

    def render(self) -> bytes:
        return generate_latest(self.registry)
