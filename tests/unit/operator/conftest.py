"""The operator tests' cluster: the strict fake API on loopback, one LLMDeployment in it, and the
operator's reconciler wired to it as kopf would wire it."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kopf
import kubernetes
import pytest

from kvfleet.operator import main
from kvfleet.operator.common import OperatorConfig
from kvfleet.operator.kube import KubeApi
from kvfleet.operator.reconcile import Reconciler, Resyncer

from .fake_kube import FakeKube, Key, running
from .fake_resources import MONITORING

LLMD_PREFIX, LLMD_PLURAL = "/apis/kvfleet.dev/v1alpha1", "llmdeployments"
DEPLOYMENTS = ("/apis/apps/v1", "deployments")
SPEC: dict[str, Any] = {
    "model": {"source": "smollm2"},
    "resources": {"gpus": 0},
    "replicas": 2,
    "gateway": {"replicas": 1},
}


@dataclass
class Cluster:
    fake: FakeKube
    memo: kopf.Memo
    resyncer: Resyncer
    key: Key = (LLMD_PREFIX, LLMD_PLURAL, "llm", "chat")

    def body(self) -> dict[str, Any]:
        """The object as kopf hands it to a handler: a snapshot."""
        found = self.fake.objects[self.key]
        return copy.deepcopy(found)

    def reconcile(self) -> None:
        main.reconcile(body=self.body(), memo=self.memo)

    def status(self) -> dict[str, Any]:
        return dict(self.fake.objects[self.key].get("status") or {})

    def conditions(self) -> dict[str, tuple[str, str]]:
        return {c["type"]: (c["status"], c["reason"]) for c in self.status()["conditions"]}

    def deployment(self, component: str) -> dict[str, Any]:
        found = self.fake.get(*DEPLOYMENTS, "llm", f"chat-{component}")
        assert found is not None
        return found

    def roll_out(
        self, component: str, ready: int | None = None, stalled: bool = False
    ) -> dict[str, Any]:
        """Play the Deployment controller: every pod updated, `ready` of them available, and
        its Progressing condition as the controller sets it (finished when all are available;
        ProgressDeadlineExceeded once `stalled`)."""
        deployment = self.deployment(component)
        want = deployment["spec"]["replicas"]
        available = want if ready is None else ready
        if stalled:
            progress = ("False", "ProgressDeadlineExceeded", 'ReplicaSet "x" has timed out')
        elif available == want:
            progress = ("True", "NewReplicaSetAvailable", 'ReplicaSet "x" has progressed')
        else:
            progress = ("True", "ReplicaSetUpdated", 'ReplicaSet "x" is progressing')
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": want,
            "updatedReplicas": want,
            "readyReplicas": available,
            "availableReplicas": available,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if available else "False",
                    "reason": "MinimumReplicasAvailable"
                    if available
                    else "MinimumReplicasUnavailable",
                },
                dict(
                    zip(("status", "reason", "message"), progress, strict=True), type="Progressing"
                ),
            ],
        }
        self.fake.set_status((*DEPLOYMENTS, "llm", f"chat-{component}"), status)
        return copy.deepcopy(self.deployment(component))

    def resync(self) -> None:
        self.resyncer.resync(self.body())

    def events(self) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the Events on the LLMDeployment, oldest first."""
        return [(e["type"], e["reason"], e["message"]) for e in self.fake.events_for("chat")]


def clock() -> Iterator[str]:
    for second in itertools.count():
        yield f"2026-11-22T10:{second // 60:02d}:{second % 60:02d}Z"


def client_for(url: str) -> KubeApi:
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    return KubeApi(kubernetes.client.ApiClient(configuration), timeout_s=5)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    fake = FakeKube(crds=tuple(MONITORING))
    with running(fake) as url:
        ticks = clock()
        reconciler = Reconciler(client_for(url), OperatorConfig(), clock=lambda: next(ticks))
        found = Cluster(fake, kopf.Memo(reconciler=reconciler), Resyncer(reconciler))
        fake.create(
            LLMD_PREFIX,
            LLMD_PLURAL,
            {
                "apiVersion": "kvfleet.dev/v1alpha1",
                "kind": "LLMDeployment",
                "metadata": {"name": "chat", "namespace": "llm"},
                "spec": copy.deepcopy(SPEC),
            },
        )
        yield found
