"""Engine metrics for Prometheus: `kvfleet:` names with vLLM semantics, and `vllm:` twins on demand.

Gauges and cumulative counters are read from the engine at scrape time; latency histograms and
per-request counters are fed as requests finish. Each app has its own registry (no globals).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.engine.core.stats import SpecDecodeStats
from kvfleet.engine.output.request_output import RequestOutput

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


@dataclass(frozen=True)
class EngineStats:
    """A reading of the engine's state for a scrape."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_preemptions_swapped: int = 0  # of which swapped out to host memory, not recomputed
    # LoRA (None when off): adapters of running and of waiting requests, and the slot count
    lora: tuple[list[str], list[str], int] | None = None
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
    num_step_failures: int = 0  # steps that raised (recovered from, or fatal)
    num_requests_isolated: int = 0  # requests failed alone for making steps fail
    num_kernel_compiles: int = 0  # Triton kernels compiled while serving (`compile_watch`)


class _EngineCollector(Collector):
    def __init__(
        self, prefixes: list[str], model_name: str, read: Callable[[], EngineStats | None]
    ):
        self.prefixes = prefixes
        self.model_name = model_name
        self.read = read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        if stats is None:  # still loading
            return
        for p in self.prefixes:
            for name, doc, value in (
                (
                    "num_requests_running",
                    "Requests being computed in the engine.",
                    stats.num_running,
                ),
                ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
                (
                    "kv_cache_usage_perc",
                    "Fraction of KV-cache blocks in use (0 to 1).",
                    stats.kv_cache_usage,
                ),
            ):
                gauge = GaugeMetricFamily(p + name, doc, labels=["model_name"])
                gauge.add_metric([self.model_name], value)
                yield gauge
            counters = [
                (
                    "prefix_cache_queries",
                    "Prompt tokens looked up in the prefix cache.",
                    stats.prefix_cache_queries,
                ),
                (
                    "prefix_cache_hits",
                    "Prompt tokens found in the prefix cache.",
                    stats.prefix_cache_hits,
                ),
                (
                    "num_preemptions",
                    "Requests preempted for lack of KV-cache blocks.",
                    stats.num_preemptions,
                ),
            ]
            if p == "kvfleet:":  # (no vLLM twins: vLLM has no such counters)
                counters += [
                    ("engine_step_failures", "Engine steps that raised.", stats.num_step_failures),
                    (
                        "requests_isolated",
                        "Requests failed alone for making engine steps fail.",
                        stats.num_requests_isolated,
                    ),
                    (
                        "kernel_compiles_while_serving",
                        "Triton kernels compiled after the warm-up (each stalls its step).",
                        stats.num_kernel_compiles,
                    ),
                ]
            for name, doc, value in counters:
                counter = CounterMetricFamily(p + name, doc, labels=["model_name"])
                counter.add_metric([self.model_name], value)
                yield counter
            if p == "kvfleet:":
                yield _preemptions_by_kind(p, self.model_name, stats)
            if stats.lora is not None:
                yield _lora_info(p, stats.lora)
            if stats.spec_decode is not None:
                yield from _spec_decode(p, self.model_name, stats.spec_decode)


def _preemptions_by_kind(prefix: str, model_name: str, stats: EngineStats) -> Metric:
    counter = CounterMetricFamily(
        prefix + "preemptions_by_kind",
        "Requests preempted for lack of KV-cache blocks, by how they come back: swapped out to "
        "host memory and copied back, or recomputed.",
        labels=["model_name", "kind"],
    )
    swapped = stats.num_preemptions_swapped
    counter.add_metric([model_name, "swap"], swapped)
    counter.add_metric([model_name, "recompute"], stats.num_preemptions - swapped)
    return counter


def _spec_decode(prefix: str, model_name: str, stats: SpecDecodeStats) -> Iterator[Metric]:
    """vLLM's speculative counters, and the mean acceptance length (tokens a drafted step
    emits per request, since the start)."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Requests' steps that carried drafts.", stats.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens),
        (
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.num_accepted_tokens,
        ),
    ):
        counter = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
        counter.add_metric([model_name], value)
        yield counter
    gauge = GaugeMetricFamily(
        prefix + "spec_decode_mean_acceptance_length",
        "Tokens a drafted step emits per request on average (1 + accepted per draft run).",
        labels=["model_name"],
    )
    gauge.add_metric([model_name], stats.mean_acceptance_length)
    yield gauge


def _lora_info(prefix: str, lora: tuple[list[str], list[str], int]) -> Metric:
    """As vLLM's: the value is the scrape time, the labels carry the adapter names."""
    running, waiting, max_lora = lora
    gauge = GaugeMetricFamily(
        prefix + "lora_requests_info",
        "Running and waiting LoRA adapters (comma-separated) and the device slots.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    gauge.add_metric([",".join(running), ",".join(waiting), str(max_lora)], time.time())
    return gauge


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        read_stats: Callable[[], EngineStats | None],
        vllm_compat: bool = False,
    ):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        prefixes = ["kvfleet:"] + (["vllm:"] if vllm_compat else [])
        self.registry.register(_EngineCollector(prefixes, model_name, read_stats))

        def counter(name: str, doc: str, *labels: str) -> list[Counter]:
            return [
                Counter(p + name, doc, ["model_name", *labels], registry=self.registry)
                for p in prefixes
            ]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> list[Histogram]:
            return [
                Histogram(p + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
                for p in prefixes
            ]

        self.model_info = Gauge(
            "kvfleet:model_info",
            "The served model (1): its weights' dtype and quantization method.",
            ["model_name", "dtype", "quantization"],
            registry=self.registry,
        )
        # One metric per prefix (kvfleet:, and vllm: in compat mode), updated together.
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", "finished_reason"
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Waiting before first scheduled.", E2E_BUCKETS
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Count a finished request. Runs on the engine thread: prometheus_client is thread-safe."""
        m = output.metrics
        generated = sum(len(c.token_ids) for c in output.outputs)
        reasons = [c.finish_reason or "abort" for c in output.outputs]
        for i in range(len(self.prompt_tokens)):
            self.prompt_tokens[i].labels(self.model_name).inc(len(output.prompt_token_ids))
            self.generation_tokens[i].labels(self.model_name).inc(generated)
            for reason in reasons:
                self.request_success[i].labels(self.model_name, reason).inc()
            if m.time_to_first_token is not None:
                self.ttft[i].labels(self.model_name).observe(m.time_to_first_token)
            if m.queue_time is not None:
                self.queue_time[i].labels(self.model_name).observe(m.queue_time)
            if m.finished_time is not None:
                self.e2e[i].labels(self.model_name).observe(m.finished_time - m.arrival_time)

    def observe_inter_token(self, seconds_per_token: float, num_tokens: int) -> None:
        for histogram in self.itl:
            for _ in range(num_tokens):
                histogram.labels(self.model_name).observe(seconds_per_token)

    def describe_model(self, dtype: str, quantization: str) -> None:
        """Once loaded: `kvfleet:model_info` labelled with the dtype and quantization."""
        self.model_info.labels(self.model_name, dtype, quantization).set(1)
