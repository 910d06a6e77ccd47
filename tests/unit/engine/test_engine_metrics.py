"""The engine's scrape-time metrics (engine/server/metrics.py): preemptions by kind."""

from __future__ import annotations

from kvfleet.engine.server.metrics import EngineStats, _EngineCollector


def test_preemptions_are_counted_by_kind_beside_vllms_total() -> None:
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.5,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=5,
        num_preemptions_swapped=3,
    )
    collector = _EngineCollector(["vllm:", "kvfleet:"], "m", lambda: stats)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }
    by_kind = {
        dict(labels)["kind"]: value
        for (name, labels), value in samples.items()
        if name == "kvfleet:preemptions_by_kind_total"
    }
    assert by_kind == {"swap": 3, "recompute": 2}
    assert samples["vllm:num_preemptions_total", (("model_name", "m"),)] == 5
    assert not any(name.startswith("vllm:preemptions_by_kind") for name, _ in samples)
