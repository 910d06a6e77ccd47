"""Several gateway pods of one LLMDeployment: exactly one writes `/scale`, elected with a Lease,
and another takes over within the lease duration when it dies. Against the strict fake API, as
the gateway's ServiceAccount with the Role the operator wrote for it."""

from __future__ import annotations

import copy
import time
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


def elector(url: str, identity: str) -> LeaderElector:
    store = KubernetesLeaseStore("llm", autoscaler_lease_name("chat"), gateway_client(url))
    return LeaderElector(store, identity, lease_duration_s=1.0, retry_period_s=0.2)


def test_one_leader_and_a_new_one_within_the_lease_duration(
    cluster: tuple[FakeKube, str],
) -> None:
    fake, url = cluster
    a, b = elector(url, "gateway-a"), elector(url, "gateway-b")
    assert a.try_acquire_or_renew()
    deadline = time.monotonic() + 2.5  # more than two lease durations with both alive
    while time.monotonic() < deadline:
        assert a.try_acquire_or_renew()
        assert not b.try_acquire_or_renew()
        time.sleep(0.2)
    # a dies (stops renewing): b leads within the lease duration (plus one retry period)
    died = time.monotonic()
    while not b.try_acquire_or_renew():
        assert time.monotonic() - died < 1.0 + 0.2 + 0.3, "no new leader in time"
        time.sleep(0.2)
    took_over_s = time.monotonic() - died
    assert took_over_s <= 1.5
    lease = fake.get("/apis/coordination.k8s.io/v1", "leases", "llm", "chat-autoscaler")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "gateway-b"
    assert lease["spec"]["leaseTransitions"] == 1
    assert fake.denied == []
    # a comes back: it follows (b renews)
    assert b.try_acquire_or_renew()
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
