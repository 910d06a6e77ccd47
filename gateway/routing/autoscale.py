"""Autoscaling: replica counts from the engines' load, with stabilization windows (as the HPA's).

`recommend` turns one reading of the ready replicas (KV-cache utilization, waiting and running
requests) into the count that would bring the busiest signal to its target; `stabilize` then
keeps a scale-down from happening until every recommendation in the down window agreed (and a
scale-up until every one in the up window did), and clamps to [min, max]. Pure: the caller
passes the time and keeps the history.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfleet.gateway.routing.snapshot import ReplicaId, ReplicaState


@dataclass(frozen=True)
class AutoscalePolicy:
    min_replicas: int
    max_replicas: int
    target_kv_cache_usage: float = 0.7  # mean over ready replicas
    target_waiting_per_replica: float = 2.0
    scale_up_window_s: float = 0.0  # react to load at once
    scale_down_window_s: float = 300.0  # but release replicas only after 5 minutes of calm
    max_scale_up_step: int = 4  # replicas added per decision at most

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max >= 1, got "
                f"{self.min_replicas}..{self.max_replicas}"
            )
        if not 0 < self.target_kv_cache_usage <= 1 or self.target_waiting_per_replica <= 0:
            raise ValueError("targets must be positive (KV-cache usage at most 1)")


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


def recommend(
    replicas: Sequence[ReplicaState],
    current: int,
    policy: AutoscalePolicy,
    active: bool = False,
) -> int:
    """The count for this reading alone. No ready replica: keep `current` (at least min).
    `active`: requests finished since the last reading (so engines seen without running or
    waiting requests were not idle in between: no drop to the minimum, which may be zero)."""
    ready = [r for r in replicas if r.ready]
    if not ready:
        return max(current, policy.min_replicas, 1 if policy.min_replicas else 0)
    usage = sum(r.kv_cache_usage for r in ready) / len(ready)
    waiting = sum(r.num_waiting for r in ready)
    ratio = max(
        usage / policy.target_kv_cache_usage,
        waiting / (policy.target_waiting_per_replica * len(ready)),
    )
    # Within 10% of the target: stay (as the HPA's tolerance), so the count does not flap.
    if abs(ratio - 1.0) <= 0.1:
        return current
    idle = not active and all(r.num_running == 0 and r.num_waiting == 0 for r in ready)
    # Work under way (or just done) keeps at least one replica, whatever the ratio says.
    desired = policy.min_replicas if idle else max(1, math.ceil(len(ready) * ratio))
    return min(desired, current + policy.max_scale_up_step)


def finished_since(
    replicas: Sequence[ReplicaState], before: Mapping[ReplicaId, float]
) -> tuple[bool, dict[ReplicaId, float]]:
    """Whether any replica finished requests since the `before` counters, and the counters to
    keep (a replica seen for the first time, or restarted, counts as no news)."""
    now = {r.replica_id: r.num_finished for r in replicas if r.ready}
    moved = any(count > before[rid] for rid, count in now.items() if rid in before)
    return moved, now


def stabilize(
    desired: int,
    now: float,
    history: Sequence[Recommendation],
    current: int,
    policy: AutoscalePolicy,
    *,
    observing_since: float,
) -> tuple[int, list[Recommendation]]:
    """The count to apply now, and the history to keep (recommendations inside the longer
    window, this one included). `observing_since`: when this decider's own history began; it
    scales down only once that history covers a whole down window (a restarted gateway knows
    nothing of the load before it, so calm since its start proves nothing)."""
    keep_s = max(policy.scale_up_window_s, policy.scale_down_window_s)
    kept = [r for r in history if now - r.at <= keep_s] + [Recommendation(now, desired)]
    up = [r.replicas for r in kept if now - r.at <= policy.scale_up_window_s]
    down = [r.replicas for r in kept if now - r.at <= policy.scale_down_window_s]
    result = current
    if desired > current:
        result = max(current, min(up))  # every recent recommendation wanted at least this
    elif desired < current and now - observing_since >= policy.scale_down_window_s:
        result = min(current, max(down))  # no recent recommendation wanted more
    return min(max(result, policy.min_replicas), policy.max_replicas), kept
