"""Autoscaling: recommendations from load, tolerance, stabilization windows, clamping."""

from __future__ import annotations

import pytest

from kvfleet.gateway.routing.autoscale import (
    AutoscalePolicy,
    Recommendation,
    finished_since,
    recommend,
    stabilize,
)
from kvfleet.gateway.routing.snapshot import ReplicaId, ReplicaState

POLICY = AutoscalePolicy(min_replicas=1, max_replicas=10, scale_down_window_s=300)


def replicas(*loads: tuple[float, int, int], ready: bool = True) -> list[ReplicaState]:
    """(kv usage, waiting, running) per replica."""
    return [
        ReplicaState(ReplicaId(f"r{i}"), ready, usage, running, waiting)
        for i, (usage, waiting, running) in enumerate(loads)
    ]


def test_recommend_follows_the_busiest_signal() -> None:
    # KV at 0.9 against 0.7 on 2 replicas -> ceil(2 * 1.29) = 3
    assert recommend(replicas((0.9, 0, 8), (0.9, 0, 8)), 2, POLICY) == 3
    # 12 waiting on 2 replicas against 2 each -> ceil(2 * 3) = 6
    assert recommend(replicas((0.3, 6, 8), (0.3, 6, 8)), 2, POLICY) == 6
    # Light load: 4 replicas at 0.2 -> ceil(4 * 0.29) = 2
    assert recommend(replicas(*[(0.2, 0, 1)] * 4), 4, POLICY) == 2
    # Within 10% of the target: stay
    assert recommend(replicas((0.74, 0, 4), (0.66, 0, 4)), 2, POLICY) == 2
    # Nothing at all to do: the minimum
    assert recommend(replicas((0.0, 0, 0), (0.0, 0, 0)), 2, POLICY) == 1


def test_scale_up_is_bounded_per_step_and_no_reading_keeps_the_count() -> None:
    assert recommend(replicas((1.0, 50, 8)), 1, POLICY) == 5  # 1 + max_scale_up_step
    assert recommend(replicas((0.5, 0, 1), ready=False), 3, POLICY) == 3


def test_scale_down_waits_for_the_window() -> None:
    # Busy at t=0 (4 recommended), calm since: no drop while that recommendation is in the
    # 300 s window, then straight to what the calm asked for.
    history = [Recommendation(0.0, 4)]
    count = 4
    for t in (100.0, 200.0, 299.0):
        count, history = stabilize(2, t, history, count, POLICY, observing_since=-1000.0)
        assert count == 4
    count, history = stabilize(2, 301.0, history, count, POLICY, observing_since=-1000.0)
    assert count == 2
    assert all(301.0 - r.at <= 300 for r in history)  # old entries dropped


def test_a_fresh_decider_never_scales_down_before_a_full_window_of_its_own() -> None:
    """A restarted gateway sees idle engines (2 replicas, nothing running) from its first
    reading: it keeps 2 for a whole down window of its own observations, then may drop."""
    history: list[Recommendation] = []
    count = 2
    for t in (0.0, 15.0, 150.0, 299.0):
        count, history = stabilize(1, t, history, count, POLICY, observing_since=0.0)
        assert count == 2, t
    count, history = stabilize(1, 300.0, history, count, POLICY, observing_since=0.0)
    assert count == 1
    # scaling up never waits for history
    count, _ = stabilize(5, 0.0, [], 2, POLICY, observing_since=0.0)
    assert count == 5


def test_scale_up_is_immediate_and_clamped() -> None:
    count, _ = stabilize(7, 0.0, [Recommendation(-5.0, 2)], 2, POLICY, observing_since=0.0)
    assert count == 7
    count, _ = stabilize(40, 0.0, [], 9, POLICY, observing_since=0.0)
    assert count == 10
    slow = AutoscalePolicy(min_replicas=1, max_replicas=10, scale_up_window_s=60)
    count, _history = stabilize(6, 0.0, [Recommendation(-30.0, 3)], 2, slow, observing_since=-30.0)
    assert count == 3  # only as much as every recommendation in the up window wanted


def test_policy_checks() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalePolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="targets"):
        AutoscalePolicy(min_replicas=1, max_replicas=2, target_kv_cache_usage=1.5)


def test_engines_that_finished_requests_since_the_last_reading_are_not_idle() -> None:
    zero = AutoscalePolicy(min_replicas=0, max_replicas=4)
    quiet = replicas((0.0, 0, 0))
    assert recommend(quiet, 1, zero) == 0  # nothing running, nothing finished: idle
    assert recommend(quiet, 1, zero, active=True) == 1  # short requests came and went
    first = [ReplicaState(ReplicaId("r0"), True, num_finished=7.0)]
    moved, seen = finished_since(first, {})
    assert not moved  # a replica seen for the first time is no news
    later = [ReplicaState(ReplicaId("r0"), True, num_finished=9.0)]
    assert finished_since(later, seen) == (True, {ReplicaId("r0"): 9.0})
    assert finished_since(later, {ReplicaId("r0"): 9.0})[0] is False
