"""What a user sees of the operator through the API: Events, phases and conditions that agree,
and failures that say why instead of retrying in silence. Against the strict fake API."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import kopf
import pytest

from kvfleet.operator import main
from kvfleet.operator.common import OperatorConfig, Owner
from kvfleet.operator.conditions import Phase
from kvfleet.operator.reconcile import Reconciler, Resyncer
from kvfleet.operator.spec import parse_spec
from kvfleet.operator.status import build_status

from .conftest import DEPLOYMENTS, SPEC, Cluster, client_for
from .fake_kube import FakeKube, running
from .fake_rbac import operator_cluster_role
from .fake_resources import MONITORING


def test_events_say_what_was_created_changed_and_scaled(cluster: Cluster) -> None:
    cluster.reconcile()
    created = {m for t, r, m in cluster.events() if (t, r) == ("Normal", "Created")}
    assert "Created Deployment chat-engine" in created
    assert "Created Service chat" in created
    assert len(created) == 12
    cluster.reconcile()  # nothing changed: nothing to say
    assert len(cluster.events()) == 12

    cluster.fake.update_spec(cluster.key, {**copy.deepcopy(SPEC), "replicas": 3})
    cluster.reconcile()
    new = cluster.events()[12:]
    assert ("Normal", "Updated", "Updated Deployment chat-engine") in new
    assert ("Normal", "Scaled", "Scaled engine replicas from 2 to 3") in new
    assert not any(m.endswith("chat-gateway") for _, _, m in new)  # untouched

    main.child_changed(body=cluster.roll_out("engine"), memo=cluster.memo)
    main.child_changed(body=cluster.roll_out("gateway"), memo=cluster.memo)
    assert cluster.events()[-1] == (
        "Normal",
        "Serving",
        "3/3 engine replicas ready; 1/1 gateway replicas ready",
    )


def test_a_bad_quantity_is_refused_before_any_write(cluster: Cluster) -> None:
    bad = {**copy.deepcopy(SPEC), "resources": {"gpus": 0, "memory": "1.2.3Gi"}}
    cluster.fake.update_spec(cluster.key, bad)
    with pytest.raises(kopf.PermanentError, match=r"spec\.resources\.memory"):
        cluster.reconcile()
    assert cluster.status()["phase"] == "Failed"
    assert cluster.conditions()["SpecValid"] == ("False", "InvalidSpec")
    assert [(t, r) for t, r, _ in cluster.events()] == [("Warning", "InvalidSpec")]
    assert [w for w in cluster.fake.writes if w[1] not in ("events", "llmdeployments")] == []


def test_the_fake_server_refuses_what_a_real_one_refused(cluster: Cluster) -> None:
    """Without the operator's own checks, the children reach the server and fail there as they
    did on a real API server: 500 for an unparseable quantity, 422 for a bad label value."""
    reconciler: Reconciler = cluster.memo.reconciler
    cluster.reconcile()
    owner = Owner("chat", "llm", "uid-x", parse_spec(SPEC))
    from kvfleet.operator.build_engine import build_engine_deployment

    deployment = build_engine_deployment(owner, OperatorConfig())
    bad_memory = copy.deepcopy(deployment)
    container = bad_memory["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"requests": {"memory": "1.2.3Gi"}}
    with pytest.raises(Exception, match=r"500: .*quantities must match"):
        reconciler.api.apply(bad_memory)
    bad_label = copy.deepcopy(deployment)
    bad_label["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "NVIDIA H100 80GB"}
    with pytest.raises(Exception, match=r"422: .*a valid label must be"):
        reconciler.api.apply(bad_label)


def test_a_refused_child_fails_the_object_with_the_server_message() -> None:
    """A child the server refuses (here: the operator may not create Deployments) changes
    nothing, marks the LLMDeployment Failed with the server's words, posts a Warning, and is
    retried with backoff, not every resync."""
    rules = [
        r
        if "deployments" not in r["resources"]
        else {**r, "verbs": ["get", "list", "watch", "patch"]}
        for r in operator_cluster_role()
    ]
    fake = FakeKube(crds=set(MONITORING), operator_rules=rules)
    with running(fake) as url:
        now = [0.0]
        reconciler = Reconciler(client_for(url), OperatorConfig())
        cluster = Cluster(
            fake, kopf.Memo(reconciler=reconciler), Resyncer(reconciler, monotonic=lambda: now[0])
        )
        fake.create(
            "/apis/kvfleet.dev/v1alpha1",
            "llmdeployments",
            {"metadata": {"name": "chat", "namespace": "llm"}, "spec": copy.deepcopy(SPEC)},
        )
        with pytest.raises(kopf.PermanentError, match="refused Deployment chat-engine"):
            cluster.reconcile()
        status = cluster.status()
        assert status["phase"] == "Failed"
        assert cluster.conditions()["SpecValid"] == ("False", "ChildRejected")
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert 'cannot create resource "deployments"' in ready["message"]
        # the dry run refused it: nothing at all was written
        assert [w for w in fake.writes if w[1] not in ("events", "llmdeployments")] == []
        assert [(t, r) for t, r, _ in cluster.events()] == [("Warning", "ChildRejected")]

        requests = len(fake.requests)
        cluster.resync()  # first retry
        for second in (1, 30, 59):  # within the backoff: no calls at all
            now[0] = second
            cluster.resync()
        retried = len(fake.requests)
        assert retried > requests
        now[0] = 61
        cluster.resync()  # the second retry comes a minute later, the third two minutes after
        now[0] = 62
        cluster.resync()
        assert len(fake.requests) > retried
        assert sum(1 for e in fake.events_for("chat") if e["reason"] == "ChildRejected") == 1
        (event,) = [e for e in fake.events_for("chat") if e["reason"] == "ChildRejected"]
        assert event["count"] == 3  # one Event, counted, not a flood

        fake.operator_rules = operator_cluster_role()  # an admin fixes the RBAC
        now[0] = 1000
        cluster.resync()
        assert cluster.status()["phase"] == "Pending"
        assert cluster.conditions()["SpecValid"] == ("True", "Accepted")


def test_pending_pods_make_the_phase_pending(cluster: Cluster) -> None:
    cluster.reconcile()
    main.child_changed(body=cluster.roll_out("gateway"), memo=cluster.memo)
    main.child_changed(body=cluster.roll_out("engine", ready=0), memo=cluster.memo)
    assert cluster.status()["phase"] == "Pending"
    assert cluster.conditions()["Progressing"] == ("True", "RollingOut")
    assert cluster.conditions()["Ready"] == ("False", "EngineUnavailable")


def test_a_stalled_rollout_fails_or_degrades_with_the_reason(cluster: Cluster) -> None:
    cluster.reconcile()
    main.child_changed(body=cluster.roll_out("gateway"), memo=cluster.memo)
    main.child_changed(body=cluster.roll_out("engine", ready=0, stalled=True), memo=cluster.memo)
    assert cluster.status()["phase"] == "Failed"
    assert cluster.conditions()["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert cluster.conditions()["Ready"] == ("False", "ProgressDeadlineExceeded")
    assert ("Warning", "ProgressDeadlineExceeded") in [(t, r) for t, r, _ in cluster.events()]

    main.child_changed(body=cluster.roll_out("engine", ready=1, stalled=True), memo=cluster.memo)
    assert cluster.status()["phase"] == "Degraded"  # serving, but the rollout is stuck


def _deployment(want: int, ready: int, updated: int, progress: str | None, seen: bool) -> Any:
    conditions = []
    if progress is not None:
        status = "False" if progress == "ProgressDeadlineExceeded" else "True"
        conditions = [{"type": "Progressing", "status": status, "reason": progress}]
    return {
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2 if seen else 1,
            "replicas": want,
            "updatedReplicas": updated,
            "availableReplicas": ready,
            "conditions": conditions,
        },
    }


# phase -> the (Ready, Progressing status, Progressing reason) it may show with
ALLOWED = {
    Phase.READY: {(True, "False", "RolloutComplete")},
    Phase.PROGRESSING: {(True, "True", "RollingOut")},
    Phase.PENDING: {(False, "True", "RollingOut")},
    Phase.FAILED: {(False, "False", "ProgressDeadlineExceeded")},
    Phase.DEGRADED: {
        (True, "False", "RolloutComplete"),  # fewer ready than wanted
        (False, "False", "RolloutComplete"),  # every pod lost after the rollout
        (True, "False", "ProgressDeadlineExceeded"),  # serving, the rollout stuck
    },
}


def test_phase_and_conditions_never_contradict() -> None:
    owner = Owner("chat", "llm", "uid", parse_spec({**SPEC, "replicas": 2}))
    progresses = [None, "NewReplicaSetAvailable", "ReplicaSetUpdated", "ProgressDeadlineExceeded"]
    cases = itertools.product(
        [0, 1, 2], [0, 2], progresses, [True, False], [0, 1], progresses, [None, "engine"]
    )
    seen_phases = set()
    for ready, updated, progress, seen, gw_ready, gw_progress, missing in cases:
        engine = _deployment(2, ready, updated, progress, seen) if missing is None else None
        gateway = _deployment(1, gw_ready, 1, gw_progress, True)
        status = build_status(owner, OperatorConfig(), engine, gateway, [], "t")
        phase = Phase(status["phase"])
        seen_phases.add(phase)
        found = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
        summary = (found["Ready"][0] == "True", *found["Progressing"])
        assert summary in ALLOWED[phase], (ready, updated, progress, seen, gw_ready, found)
    assert seen_phases == {
        Phase.READY,
        Phase.PROGRESSING,
        Phase.PENDING,
        Phase.DEGRADED,
        Phase.FAILED,
    }


def test_prometheus_installed_later_is_noticed() -> None:
    fake = FakeKube()
    with running(fake) as url:
        reconciler = Reconciler(client_for(url), OperatorConfig())
        cluster = Cluster(fake, kopf.Memo(reconciler=reconciler), Resyncer(reconciler))
        fake.create(
            "/apis/kvfleet.dev/v1alpha1",
            "llmdeployments",
            {"metadata": {"name": "chat", "namespace": "llm"}, "spec": copy.deepcopy(SPEC)},
        )
        cluster.reconcile()
        kinds = {o.get("kind") for o in fake.objects.values()}
        assert "PodMonitor" not in kinds
        for crd in MONITORING:
            fake.add_crd(crd)
        cluster.resync()  # the same operator process, a minute later
        kinds = {o.get("kind") for o in fake.objects.values()}
        assert {"PodMonitor", "ServiceMonitor", "PrometheusRule"} <= kinds


def test_scaling_beyond_the_autoscaling_bounds_is_said(cluster: Cluster) -> None:
    autoscaled = {
        **copy.deepcopy(SPEC),
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2},
    }
    cluster.fake.update_spec(cluster.key, autoscaled)
    cluster.reconcile()
    assert cluster.conditions()["ScalingLimited"] == ("False", "WithinBounds")
    # `kubectl scale llmd/chat --replicas=3`
    cluster.fake.update_spec(cluster.key, {**autoscaled, "replicas": 3})
    cluster.reconcile()
    assert cluster.deployment("engine")["spec"]["replicas"] == 2
    assert cluster.conditions()["ScalingLimited"] == ("True", "AboveMaxReplicas")
    limited = [m for t, r, m in cluster.events() if (t, r) == ("Warning", "AboveMaxReplicas")]
    assert limited == ["spec.replicas 3 is above autoscaling.maxReplicas 2: 2 engine replicas run"]


def test_resync_lists_and_restores_every_object(cluster: Cluster) -> None:
    cluster.reconcile()
    cluster.fake.delete(("/api/v1", "services", "llm", "chat"))
    cluster.resyncer.run_once()
    assert cluster.fake.get("/api/v1", "services", "llm", "chat") is not None
    namespaced = Resyncer(cluster.memo.reconciler, namespaces=["elsewhere"])
    cluster.fake.delete((*DEPLOYMENTS, "llm", "chat-gateway"))
    namespaced.run_once()  # watches another namespace: leaves this one alone
    assert cluster.fake.get(*DEPLOYMENTS, "llm", "chat-gateway") is None
