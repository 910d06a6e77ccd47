"""Gateway metrics for Prometheus: requests by model, key and status; latency and TTFT; queue,
rate limiting, routing decisions and prefix hits; replica health and KV-event liveness.

Counters and histograms are fed as requests go; gauges are read from the gateway at scrape
time. Each app has its own registry (no globals).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class GatewayStats:
    queue_depth: int
    in_flight: int
    replicas: list[tuple[str, bool, bool, float]]  # url, ready, KV events live, their lag (s)


class _GaugeCollector(Collector):
    def __init__(self, read: Callable[[], GatewayStats | None]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        if stats is None:
            return
        queue = GaugeMetricFamily("kvfleet:gateway_queue_depth", "Requests waiting for a slot.")
        queue.add_metric([], stats.queue_depth)
        yield queue
        flight = GaugeMetricFamily("kvfleet:gateway_in_flight", "Requests being proxied.")
        flight.add_metric([], stats.in_flight)
        yield flight
        ready = GaugeMetricFamily(
            "kvfleet:gateway_replica_ready", "1 if the replica takes requests.", labels=["replica"]
        )
        live = GaugeMetricFamily(
            "kvfleet:gateway_replica_kv_events_live",
            "1 while the replica's KV event stream is followed (0: routing from an approximate "
            "index of past requests).",
            labels=["replica"],
        )
        lag = GaugeMetricFamily(
            "kvfleet:gateway_replica_kv_events_lag_seconds",
            "How long the replica's KV event stream has been lost (0 while followed).",
            labels=["replica"],
        )
        for url, is_ready, is_live, lag_s in stats.replicas:
            ready.add_metric([url], float(is_ready))
            live.add_metric([url], float(is_live))
            lag.add_metric([url], lag_s)
        yield ready
        yield live
        yield lag


class GatewayMetrics:
    def __init__(self, read: Callable[[], GatewayStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvfleet:gateway_requests",
            "Requests answered, by model, API key and HTTP status.",
            ["model", "key", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvfleet:gateway_request_latency_seconds",
            "From request to the end of the response.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvfleet:gateway_time_to_first_token_seconds",
            "From request to the first streamed token chunk.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvfleet:gateway_inter_token_latency_seconds",
            "Gaps between streamed chunks after the first.",
            ["model"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvfleet:gateway_queue_wait_seconds",
            "Time spent waiting for a slot.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "kvfleet:gateway_rate_limited",
            "Requests refused by a rate limit, by key.",
            ["key"],
            registry=self.registry,
        )
        self.routes = Counter(
            "kvfleet:gateway_routing_decisions",
            "Routing decisions by reason (prefix, least-load, imbalance, session, ...).",
            ["reason"],
            registry=self.registry,
        )
        self.prefix_blocks = Counter(
            "kvfleet:gateway_prefix_hit_blocks",
            "Prompt blocks the chosen replica already held.",
            registry=self.registry,
        )
        self.prompt_blocks = Counter(
            "kvfleet:gateway_prompt_blocks",
            "Full prompt blocks of routed requests.",
            registry=self.registry,
        )
        self.registry.register(_GaugeCollector(read))
