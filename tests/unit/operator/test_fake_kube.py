"""The fake API refuses what a real API server refuses, so operator tests that pass against it
mean something: unknown fields, immutable fields, status outside its subresource, RBAC the
ServiceAccount lacks, blockOwnerDeletion without finalizers rights, RBAC escalation, quantities
and label values Kubernetes cannot read, stale writes."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kvfleet.operator.build_engine import build_engine_deployment
from kvfleet.operator.common import OperatorConfig, Owner
from kvfleet.operator.kube import KubeApi, KubeError
from kvfleet.operator.spec import parse_spec

from .conftest import SPEC, client_for
from .fake_kube import FakeKube, running
from .fake_rbac import operator_cluster_role

LLMD = ("/apis/kvfleet.dev/v1alpha1", "llmdeployments")


@pytest.fixture
def api() -> Iterator[tuple[FakeKube, KubeApi]]:
    fake = FakeKube()
    fake.create(*LLMD, {"metadata": {"name": "chat", "namespace": "llm"}, "spec": SPEC})
    with running(fake) as url:
        yield fake, client_for(url)


def _deployment(fake: FakeKube) -> dict[str, Any]:
    uid = fake.objects[(*LLMD, "llm", "chat")]["metadata"]["uid"]
    owner = Owner("chat", "llm", uid, parse_spec(SPEC))
    return build_engine_deployment(owner, OperatorConfig())


def _refused(call: Any, status: int, words: str) -> None:
    with pytest.raises(KubeError) as caught:
        call()
    assert caught.value.status == status, caught.value
    assert words in caught.value.message, caught.value.message


def test_unknown_and_immutable_fields(api: tuple[FakeKube, KubeApi]) -> None:
    fake, client = api
    deployment = _deployment(fake)
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["replica"] = 2
    _refused(lambda: client.apply(unknown), 422, "replica")
    client.apply(deployment)
    moved = copy.deepcopy(deployment)
    moved["spec"]["selector"]["matchLabels"]["extra"] = "x"
    moved["spec"]["template"]["metadata"]["labels"]["extra"] = "x"
    _refused(lambda: client.apply(moved), 422, "field is immutable")


def test_status_changes_only_through_its_subresource(api: tuple[FakeKube, KubeApi]) -> None:
    fake, client = api
    client.patch("LLMDeployment", "llm", "chat", {"status": {"phase": "Ready"}})
    assert "status" not in fake.objects[(*LLMD, "llm", "chat")]  # dropped, as the server does
    client.patch_status("llm", "chat", {"phase": "Ready"})
    assert fake.objects[(*LLMD, "llm", "chat")]["status"] == {"phase": "Ready"}


def test_rbac_the_operator_lacks_is_403(api: tuple[FakeKube, KubeApi]) -> None:
    fake, client = api
    fake.operator_rules = [
        r for r in operator_cluster_role() if "deployments" not in r["resources"]
    ]
    _refused(lambda: client.apply(_deployment(fake)), 403, 'cannot patch resource "deployments"')
    without_finalizers = [
        r for r in operator_cluster_role() if "llmdeployments/finalizers" not in r["resources"]
    ]
    fake.operator_rules = without_finalizers
    _refused(lambda: client.apply(_deployment(fake)), 403, "cannot set blockOwnerDeletion")
    assert len(fake.denied) == 2


def test_granting_what_one_does_not_hold_is_403(api: tuple[FakeKube, KubeApi]) -> None:
    _, client = api
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "greedy", "namespace": "llm"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
    }
    _refused(lambda: client.apply(role), 403, "attempting to grant RBAC permissions")


def test_values_kubernetes_cannot_read(api: tuple[FakeKube, KubeApi]) -> None:
    fake, client = api
    bad_quantity = _deployment(fake)
    pod = bad_quantity["spec"]["template"]["spec"]
    pod["containers"][0]["resources"] = {"limits": {"memory": "1.2.3Gi"}}
    _refused(lambda: client.apply(bad_quantity), 500, "quantities must match")
    bad_label = _deployment(fake)
    bad_label["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "NVIDIA H100 80GB"}
    _refused(lambda: client.apply(bad_label), 422, "a valid label must be")
    dry = client.apply(_deployment(fake), dry_run=True)
    assert dry.created
    assert ("/apis/apps/v1", "deployments", "llm", "chat-engine") not in fake.objects
