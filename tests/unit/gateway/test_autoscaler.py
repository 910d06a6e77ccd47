"""The autoscaling loop against a fake scale target: writes only changes, follows the windows."""

from __future__ import annotations

from kvfleet.gateway.autoscaler import Autoscaler
from kvfleet.gateway.routing.autoscale import AutoscalePolicy
from kvfleet.gateway.routing.snapshot import ClusterSnapshot, ReplicaId, ReplicaState


class FakeScale:
    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.writes: list[int] = []

    def get_replicas(self) -> int:
        return self.replicas

    def set_replicas(self, replicas: int) -> None:
        self.replicas = replicas
        self.writes.append(replicas)


def test_scale_up_at_once_down_after_the_window() -> None:
    load = {"usage": 0.95, "waiting": 6}

    def snapshot() -> ClusterSnapshot:
        return ClusterSnapshot(
            tuple(
                ReplicaState(ReplicaId(f"r{i}"), True, load["usage"], 4, load["waiting"])
                for i in range(target.replicas)
            )
        )

    target = FakeScale(2)
    scaler = Autoscaler(AutoscalePolicy(1, 8, scale_down_window_s=60), target, snapshot)
    assert scaler.step(0.0) == 6  # 12 waiting over 2 replicas against 2 each: x3
    assert target.writes == [6]
    load.update(usage=0.7, waiting=0)  # on target: stay
    assert scaler.step(10.0) == 6
    load.update(usage=0.1, waiting=0)  # calm: not before the 6 of t=0 leaves the window
    assert scaler.step(30.0) == 6
    assert scaler.step(61.0) == 6  # the t=10 "stay at 6" is still inside
    assert scaler.step(71.0) == 1
    assert target.writes == [6, 1]
