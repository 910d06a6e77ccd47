"""The kopf handlers of `kvfleet.operator.main`, called as kopf calls them, against the in-process
fake Kubernetes API (`fake_kube.py`) through the real Kubernetes client."""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest

from kvfleet.operator import main
from kvfleet.operator.common import OperatorConfig
from kvfleet.operator.reconcile import Reconciler

from .conftest import DEPLOYMENTS, LLMD_PLURAL, LLMD_PREFIX, SPEC, Cluster, client_for
from .fake_kube import FakeKube, running


def test_create_makes_every_child_owned_and_valid(cluster: Cluster) -> None:
    cluster.reconcile()
    uid = cluster.body()["metadata"]["uid"]
    children = {(o["kind"], o["metadata"]["name"]) for o in cluster.fake.owned_by(uid)}
    assert children == {
        ("ServiceAccount", "chat-gateway"),
        ("Role", "chat-gateway"),
        ("RoleBinding", "chat-gateway"),
        ("ConfigMap", "chat-gateway"),
        ("Service", "chat-engine"),
        ("Deployment", "chat-engine"),
        ("PodDisruptionBudget", "chat-engine"),
        ("Deployment", "chat-gateway"),
        ("Service", "chat"),
        ("PodMonitor", "chat-engine"),
        ("ServiceMonitor", "chat-gateway"),
        ("PrometheusRule", "chat"),
    }
    assert cluster.deployment("engine")["spec"]["replicas"] == 2
    status = cluster.status()
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == "http://chat.llm.svc.cluster.local/v1"
    assert (
        status["selector"] == "app.kubernetes.io/instance=chat,app.kubernetes.io/component=engine"
    )
    assert cluster.conditions()["SpecValid"] == ("True", "Accepted")
    assert cluster.conditions()["Ready"] == ("False", "EngineUnavailable")


def test_second_reconcile_changes_nothing(cluster: Cluster) -> None:
    cluster.reconcile()
    writes = list(cluster.fake.writes)
    versions = {k: o["metadata"]["resourceVersion"] for k, o in cluster.fake.objects.items()}
    cluster.reconcile()
    cluster.resync()
    assert cluster.fake.writes == writes
    assert {
        k: o["metadata"]["resourceVersion"] for k, o in cluster.fake.objects.items()
    } == versions


def test_status_follows_the_children(cluster: Cluster) -> None:
    cluster.reconcile()
    gateway = cluster.roll_out("gateway")
    main.child_changed(body=gateway, memo=cluster.memo)
    assert cluster.conditions()["GatewayAvailable"] == ("True", "MinimumReplicasAvailable")
    assert cluster.conditions()["Ready"] == ("False", "EngineUnavailable")
    assert cluster.status()["phase"] == "Pending"

    engine = cluster.roll_out("engine", ready=1)
    main.child_changed(body=engine, memo=cluster.memo)
    status = cluster.status()
    assert status["phase"] == "Progressing"  # serving, the second replica still starting
    assert cluster.conditions()["Progressing"] == ("True", "RollingOut")
    assert (status["replicas"], status["readyReplicas"]) == (2, 1)
    assert cluster.conditions()["Ready"] == ("True", "Serving")
    ready_since = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}

    engine = cluster.roll_out("engine")
    main.child_changed(body=engine, memo=cluster.memo)
    status = cluster.status()
    assert status["phase"] == "Ready"
    assert status["readyReplicas"] == 2
    assert cluster.conditions()["Progressing"] == ("False", "RolloutComplete")
    # Ready stayed True: its transition time did not move
    now = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    assert now["Ready"] == ready_since["Ready"]
    writes = len(cluster.fake.writes)
    cluster.resync()
    assert len(cluster.fake.writes) == writes


def test_spec_change_rolls_out(cluster: Cluster) -> None:
    cluster.reconcile()
    cluster.roll_out("engine")
    cluster.roll_out("gateway")
    cluster.reconcile()
    assert cluster.status()["phase"] == "Ready"
    spec = {**copy.deepcopy(SPEC), "engine": {"maxNumSeqs": 64}}
    cluster.fake.update_spec(cluster.key, spec)
    cluster.reconcile()
    engine = cluster.deployment("engine")
    assert engine["metadata"]["generation"] == 2
    assert "--max-num-seqs=64" in engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert cluster.deployment("gateway")["metadata"]["generation"] == 1  # untouched
    status = cluster.status()
    assert status["observedGeneration"] == 2
    assert status["phase"] == "Progressing"
    assert cluster.conditions()["Progressing"] == ("True", "RollingOut")
    main.child_changed(body=cluster.roll_out("engine"), memo=cluster.memo)
    assert cluster.status()["phase"] == "Ready"


def test_scale_subresource_drives_engine_replicas(cluster: Cluster) -> None:
    cluster.reconcile()
    # `kubectl scale llmd/chat --replicas=5` writes spec.replicas through the scale subresource
    cluster.fake.update_spec(cluster.key, {**copy.deepcopy(SPEC), "replicas": 5})
    cluster.reconcile()
    assert cluster.deployment("engine")["spec"]["replicas"] == 5
    main.child_changed(body=cluster.roll_out("engine"), memo=cluster.memo)
    assert cluster.status()["replicas"] == 5
    cluster.fake.update_spec(cluster.key, {**copy.deepcopy(SPEC), "replicas": 0})
    cluster.reconcile()
    main.child_changed(body=cluster.roll_out("engine"), memo=cluster.memo)
    assert cluster.status()["phase"] == "ScaledToZero"
    assert cluster.conditions()["EngineAvailable"] == ("False", "ScaledToZero")


def test_bad_spec_fails_permanently_with_a_condition(cluster: Cluster) -> None:
    cluster.reconcile()
    engine_before = copy.deepcopy(cluster.deployment("engine"))
    bad = {**copy.deepcopy(SPEC), "engine": {"tensorParallelSize": 3}}
    cluster.fake.update_spec(cluster.key, bad)
    with pytest.raises(kopf.PermanentError, match=r"spec\.engine\.tensorParallelSize"):
        cluster.reconcile()
    status = cluster.status()
    assert status["phase"] == "Failed"
    assert status["observedGeneration"] == 2
    spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert (spec_valid["status"], spec_valid["reason"]) == ("False", "InvalidSpec")
    assert "tensorParallelSize" in spec_valid["message"]
    assert cluster.deployment("engine") == engine_before  # the last good spec keeps serving
    # the status timer leaves a failed object alone
    writes = len(cluster.fake.writes)
    cluster.resync()
    assert len(cluster.fake.writes) == writes
    # fixing the spec recovers
    cluster.fake.update_spec(cluster.key, copy.deepcopy(SPEC))
    cluster.reconcile()
    assert cluster.conditions()["SpecValid"] == ("True", "Accepted")


def test_deletion_cleans_up_every_child(cluster: Cluster) -> None:
    cluster.reconcile()
    uid = cluster.body()["metadata"]["uid"]
    assert len(cluster.fake.owned_by(uid)) == 12
    cluster.fake.delete(cluster.key)  # what `kubectl delete llmd/chat` leads to
    left = {(k[1], k[3]) for k in cluster.fake.objects if k[2] == "llm" and k[1] != "events"}
    assert left == set()


def test_monitoring_off_removes_monitoring_objects(cluster: Cluster) -> None:
    cluster.reconcile()
    cluster.fake.update_spec(cluster.key, {**copy.deepcopy(SPEC), "monitoring": {"enabled": False}})
    cluster.reconcile()
    kinds = {o["kind"] for o in cluster.fake.objects.values()}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert "Deployment" in kinds


def test_no_monitoring_objects_without_their_crds() -> None:
    fake = FakeKube(crds=())
    with running(fake) as url:
        reconciler = Reconciler(client_for(url), OperatorConfig())
        obj = fake.create(
            LLMD_PREFIX,
            LLMD_PLURAL,
            {"metadata": {"name": "chat", "namespace": "llm"}, "spec": copy.deepcopy(SPEC)},
        )
        main.reconcile(body=copy.deepcopy(obj), memo=kopf.Memo(reconciler=reconciler))
    kinds = {o["kind"] for o in fake.objects.values() if o.get("kind")}
    assert "Deployment" in kinds
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def test_unreachable_api_is_a_temporary_error(cluster: Cluster) -> None:
    dead = Reconciler(client_for("http://127.0.0.1:9"), OperatorConfig())
    with pytest.raises(kopf.TemporaryError) as caught:
        main.reconcile(body=cluster.body(), memo=kopf.Memo(reconciler=dead))
    assert caught.value.delay == 10


def test_a_deployment_without_owner_is_ignored(cluster: Cluster) -> None:
    stranger = {"metadata": {"name": "other", "namespace": "llm"}}
    main.child_changed(body=stranger, memo=cluster.memo)
    assert cluster.fake.writes == []


def test_startup_without_a_cluster_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = kopf.OperatorSettings()
    with pytest.raises(kopf.PermanentError, match="no Kubernetes cluster is reachable"):
        asyncio.run(main.startup(settings=settings, memo=kopf.Memo()))
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)


def test_a_child_deleted_by_hand_is_put_back(cluster: Cluster) -> None:
    cluster.reconcile()
    gone = copy.deepcopy(cluster.deployment("engine"))
    cluster.fake.delete((*DEPLOYMENTS, "llm", "chat-engine"))
    main.child_changed(body=gone, memo=cluster.memo, type="DELETED")
    assert cluster.deployment("engine")["spec"]["replicas"] == 2
    # the resync puts back anything else, e.g. the engine Service
    cluster.fake.delete(("/api/v1", "services", "llm", "chat-engine"))
    cluster.resync()
    assert cluster.fake.get("/api/v1", "services", "llm", "chat-engine") is not None
