"""The engine's scrape-time metrics (engine/server/metrics.py): preemptions by kind, kernels
compiled while serving."""

from __future__ import annotations

from kvfleet.engine.server.metrics import EngineStats, _EngineCollector


def _scraped(
    num_preemptions: int = 0, **counts: int
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, labels) -> value of a scrape of both prefixes' metrics, over stats with `counts`."""
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.5,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=num_preemptions,
        **counts,
    )
    collector = _EngineCollector(["vllm:", "kvfleet:"], "m", lambda: stats)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def test_preemptions_are_counted_by_kind_beside_vllms_total() -> None:
    samples = _scraped(num_preemptions=5, num_preemptions_swapped=3)
    by_kind = {
        dict(labels)["kind"]: value
        for (name, labels), value in samples.items()
        if name == "kvfleet:preemptions_by_kind_total"
    }
    assert by_kind == {"swap": 3, "recompute": 2}
    assert samples["vllm:num_preemptions_total", (("model_name", "m"),)] == 5
    assert not any(name.startswith("vllm:preemptions_by_kind") for name, _ in samples)


def test_kernels_compiled_while_serving_are_counted() -> None:
    samples = _scraped(num_kernel_compiles=3)
    assert samples["kvfleet:kernel_compiles_while_serving_total", (("model_name", "m"),)] == 3
    assert not any(name.startswith("vllm:kernel_compiles") for name, _ in samples)
