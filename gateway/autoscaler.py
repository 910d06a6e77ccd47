"""The autoscaling loop (cluster mode): engine load -> replica count -> the LLMDeployment's
`scale` subresource, which the operator turns into engine pods.

The decision is `routing.autoscale` (pure); here it is run on a timer against a ScaleTarget. The
Kubernetes target reads and writes `.../llmdeployments/NAME/scale` through the API server (the
same subresource an HPA or KEDA would use).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kvfleet.gateway.incluster import api_client_or_in_cluster
from kvfleet.gateway.routing.autoscale import (
    AutoscalePolicy,
    Recommendation,
    finished_since,
    recommend,
    stabilize,
)
from kvfleet.gateway.routing.snapshot import ClusterSnapshot, ReplicaId

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "kvfleet.dev", "v1alpha1", "llmdeployments"


class ScaleTarget(Protocol):
    def get_replicas(self) -> int: ...

    def set_replicas(self, replicas: int) -> None: ...


class Autoscaler:
    def __init__(
        self,
        policy: AutoscalePolicy,
        target: ScaleTarget,
        snapshot: Callable[[], ClusterSnapshot],
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self.policy = policy
        self.target = target
        self.snapshot = snapshot
        self.is_leader = is_leader  # several gateway pods: only the Lease holder decides
        self.history: list[Recommendation] = []
        self.observing_since: float | None = None  # the first decision's time as leader
        self.finished: dict[ReplicaId, float] = {}  # engines' finished-request counters

    def step(self, now: float) -> int | None:
        """One decision: read the current count, recommend, stabilize, write if it changed.
        None when another gateway pod leads (this one forgets its history: should it lead
        later, it first watches the load for a whole down window)."""
        if not self.is_leader():
            self.history, self.observing_since = [], None
            return None
        current = self.target.get_replicas()
        if self.observing_since is None:
            self.observing_since = now
        seen = self.snapshot().replicas
        active, self.finished = finished_since(seen, self.finished)
        desired = recommend(seen, current, self.policy, active)
        replicas, self.history = stabilize(
            desired, now, self.history, current, self.policy, observing_since=self.observing_since
        )
        if replicas != current:
            logger.info(
                "autoscaling: %d -> %d replicas (recommended %d)", current, replicas, desired
            )
            self.target.set_replicas(replicas)
        return replicas

    async def run(self, interval_s: float, clock: Callable[[], float]) -> None:
        while True:
            try:
                await asyncio.to_thread(self.step, clock())
            except Exception:  # the API server may be away: decide again next time
                logger.exception("autoscaling step failed")
            await asyncio.sleep(interval_s)


class KubernetesScaleTarget:
    """The `scale` subresource of one LLMDeployment, through the in-cluster API."""

    def __init__(self, namespace: str, name: str, api_client: Any = None) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client_or_in_cluster(api_client))
        self.namespace, self.name = namespace, name

    def get_replicas(self) -> int:
        scale: Any = self.api.get_namespaced_custom_object_scale(
            GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        return int(scale.get("spec", {}).get("replicas", 0))

    def set_replicas(self, replicas: int) -> None:
        self.api.patch_namespaced_custom_object_scale(
            GROUP, VERSION, self.namespace, PLURAL, self.name, {"spec": {"replicas": replicas}}
        )
