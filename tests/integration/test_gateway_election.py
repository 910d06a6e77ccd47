"""Several gateway pods of one LLMDeployment: exactly one writes `/scale`, elected with a Lease,
and another takes over within the lease duration when it dies. Against the strict fake API, as
the gateway's ServiceAccount with the Role the operator wrote for it."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest

from kvfleet.gateway.autoscaler import Autoscaler, KubernetesScaleTarget
from kvfleet.gateway.leader import KubernetesLeaseStore, LeaderElector, autoscaler_lease_name
from kvfleet.gateway.routing.autoscale import AutoscalePolicy
from kvfleet.gateway.routing.snapshot import ClusterSnapshot, ReplicaId, ReplicaState
from kvfleet.operator.common import OperatorConfig
from kvfleet.operator.reconcile import Reconciler

from ..unit.operator.conftest import SPEC, client_for
from ..unit.operator.fake_kube import FakeKube, running

LLMD = ("/apis/kvfleet.dev/v1alpha1", "llmdeployments")
GATEWAY_SA = "system:serviceaccount:llm:chat-gateway"


def gateway_client(url: str) -> Any:
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    configuration.api_key = {"BearerToken": "gateway-token"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return kubernetes.client.ApiClient(configuration)


@pytest.fixture
def cluster() -> Iterator[tuple[FakeKube, str]]:
    """An autoscaled LLMDeployment reconciled by the operator (so the gateway's Role exists)."""
    fake = FakeKube()
    fake.tokens["gateway-token"] = GATEWAY_SA
    spec = {**copy.deepcopy(SPEC), "autoscaling": {"enabled": True, "maxReplicas": 6}}
    fake.create(*LLMD, {"metadata": {"name": "chat", "namespace": "llm"}, "spec": spec})
    with running(fake) as url:
        Reconciler(client_for(url), OperatorConfig()).reconcile(
            fake.objects[(*LLMD, "llm", "chat")]
        )
        yield fake, url


class Clock:
    """A pod's own monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def elector(url: str, identity: str, clock: Clock | None = None) -> LeaderElector:
    store = KubernetesLeaseStore("llm", autoscaler_lease_name("chat"), gateway_client(url))
    monotonic = clock or Clock()
    return LeaderElector(
        store, identity, lease_duration_s=15, retry_period_s=5, monotonic=monotonic
    )


def test_one_leader_and_a_new_one_within_the_lease_duration(
    cluster: tuple[FakeKube, str],
) -> None:
    fake, url = cluster
    a_clock, b_clock = Clock(), Clock()
    a, b = elector(url, "gateway-a", a_clock), elector(url, "gateway-b", b_clock)
    assert a.try_acquire_or_renew()
    for _ in range(8):  # 40 s, more than two lease durations, both alive: a keeps it
        a_clock.now += 5
        b_clock.now += 5
        assert a.try_acquire_or_renew()
        assert not b.try_acquire_or_renew()
    # a dies (stops renewing): b takes over once the record has not moved for 15 s on its clock
    rounds = 0
    while not b.try_acquire_or_renew():
        rounds += 1
        b_clock.now += 5
        assert rounds <= 3, "no new leader within the lease duration"
    assert rounds == 3  # 15 s after it last saw the record move: within one lease duration
    lease = fake.get("/apis/coordination.k8s.io/v1", "leases", "llm", "chat-autoscaler")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "gateway-b"
    assert lease["spec"]["leaseTransitions"] == 1
    assert fake.denied == []
    # a comes back: it follows (b renews)
    assert b.try_acquire_or_renew()
    a_clock.now += 5
    assert not a.try_acquire_or_renew()


def test_only_the_leader_writes_the_scale(cluster: tuple[FakeKube, str]) -> None:
    fake, url = cluster
    a, b = elector(url, "gateway-a"), elector(url, "gateway-b")
    a.try_acquire_or_renew()
    b.try_acquire_or_renew()
    busy = ClusterSnapshot((ReplicaState(ReplicaId("r0"), True, 0.3, 8, 12),))
    policy = AutoscalePolicy(1, 6)
    scalers = [
        Autoscaler(
            policy,
            KubernetesScaleTarget("llm", "chat", gateway_client(url)),
            lambda: busy,
            lambda e=e: e.is_leader,  # type: ignore[misc]
        )
        for e in (a, b)
    ]
    results = [s.step(0.0) for s in scalers]
    assert results == [6, None]  # 12 waiting on 1 replica, target 2 each: 2 + 4 at most
    assert fake.objects[(*LLMD, "llm", "chat")]["spec"]["replicas"] == 6
    assert [w for w in fake.writes if w[0] == "scale"] == [("scale", "llmdeployments", "chat")]
    assert fake.denied == []
