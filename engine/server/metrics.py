"""``/metrics``: the engine's counters in Prometheus text format, named in the style of
vLLM's (``vllm:...``) and llama-server's metrics, under ``engine:``.

Counters and gauges are read from :class:`EngineMetrics` at scrape time (one copy of every
count: the engine's); latency histograms are fed by the engine's per-request listener, so
they cover every request the engine serves, over HTTP or in-process. Each app has its own
registry: nothing is registered in ``prometheus_client``'s global one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ..scheduler import Engine, RequestMetrics

__all__ = ["EngineCollector", "metrics_registry"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class EngineCollector(Collector):
    """The engine's counters and gauges, read when scraped. ``vllm_names``: the gauges a
    router or gateway schedules on (waiting and running requests, KV-cache use) also
    under vLLM's names, which Kubernetes' Gateway API Inference Extension (llm-d) reads."""

    def __init__(self, engine: Engine, model_name: str, vllm_names: bool = False) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.vllm_names = vllm_names

    def collect(self) -> Iterator[Any]:
        m = self.engine.metrics
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"engine:{name}", doc, labels=names)
            c.add_metric(values, value)
            return c

        def gauge(name: str, doc: str, value: float, prefix: str = "engine") -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        finished = CounterMetricFamily(
            "engine:request_success", "Requests ended, by finish reason.", labels=[*names, "finished_reason"]
        )
        for reason, count in sorted(m.finish_reasons.items()):
            finished.add_metric([*values, reason], count)
        yield finished
        yield counter("prompt_tokens", "Prompt tokens of the requests admitted.", m.prompt_tokens)
        yield counter(
            "prompt_tokens_cached", "Prompt tokens a cached prefix saved from prefill.", m.cached_tokens
        )
        yield counter("prefix_cache_hits", "Requests that reused a cached prefix.", m.prefix_hits)
        yield counter("generation_tokens", "Tokens generated (handed to callers).", m.generated_tokens)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", m.drafted)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted and kept.", m.accepted)
        per_pos = CounterMetricFamily(
            "engine:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            labels=[*names, "position"],
        )
        for pos, count in enumerate(m.accepted_per_position):
            per_pos.add_metric([*values, str(pos)], count)
        yield per_pos
        yield counter("preemptions", "Running requests swapped out for waiting ones.", m.preemptions)
        load = self.engine.load()
        scheduling = [
            ("num_requests_waiting", "Requests waiting for a sequence slot.", load.waiting),
            ("num_requests_running", "Requests holding a sequence slot.", load.running),
            ("kv_cache_usage_perc", "Share of the KV cache held by running requests (0-1).", load.kv_usage),
        ]
        for name, doc, value in scheduling:
            yield gauge(name, doc, value)
            if self.vllm_names:
                yield gauge(name, doc, value, prefix="vllm")
        yield gauge("kv_cache_running_cells", "KV cells held by running requests.", load.kv_running)
        yield gauge(
            "kv_cache_cached_cells", "KV cells held by idle sequences kept for prefix reuse.", load.kv_cached
        )
        yield gauge("kv_cache_capacity_cells", "KV cells of every sequence slot.", load.kv_capacity)
        yield gauge("batch_occupancy", "Mean share of the sequence slots each step used.", m.batch_occupancy)
        yield gauge("spec_decode_acceptance_rate", "Accepted ÷ drafted tokens.", m.acceptance_rate)
        yield gauge("swapped_bytes", "Host memory held by preempted requests' state.", m.swapped_bytes)
        step = SummaryMetricFamily("engine:step_seconds", "Time of the native engine step.", labels=names)
        step.add_metric(values, m.steps, m.step_seconds)
        yield step
        host = SummaryMetricFamily(
            "engine:host_seconds",
            "Time of the event loop planning a step and applying its result.",
            labels=names,
        )
        host.add_metric(values, m.steps, m.host_seconds)
        yield host


def metrics_registry(engine: Engine, model_name: str, vllm_names: bool = False) -> CollectorRegistry:
    """A registry with the engine's collector and its latency histograms (fed per request)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine, model_name, vllm_names))
    labels = ["model_name"]

    def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"engine:{name}", doc, labels, registry=registry, buckets=buckets)

    ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
    tpot = histogram(
        "time_per_output_token_seconds", "Mean inter-token latency of a request.", _TOKEN_BUCKETS
    )
    e2e = histogram("e2e_request_latency_seconds", "Arrival to end of a request.", _LATENCY_BUCKETS)

    def observe(r: RequestMetrics) -> None:
        if r.ttft is not None:
            ttft.labels(model_name).observe(r.ttft)
        if r.first_token is not None and r.finished is not None and r.completion_tokens > 1:
            tpot.labels(model_name).observe((r.finished - r.first_token) / (r.completion_tokens - 1))
        if r.finished is not None:
            e2e.labels(model_name).observe(r.finished - r.arrival)

    engine.metrics.listeners.append(observe)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
