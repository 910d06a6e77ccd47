"""The whole life of an LLMDeployment on a kind cluster, CPU only (manifests/samples/smollm2-cpu).

In order: the CRD installed by `kubectl apply -k manifests/` -> apply -> Ready -> chat through the
gateway with the openai client -> `kubectl describe` lists Events -> `kubectl scale` -> autoscaling
under load -> rolling update -> a bad spec Failed with the server's reason -> delete with the
operator stopped, and nothing left. The session fixture builds the images from this checkout and
installs kvfleet (`e2e/kind.sh all`).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import Cluster, sample

NAMESPACE = "kvfleet-e2e"
NAME = "smollm2"
INSTANCE = f"app.kubernetes.io/instance={NAME}"


@pytest.fixture(scope="module")
def deployed(kind_cluster: Cluster) -> Iterator[Cluster]:
    kind_cluster.run("create", "namespace", NAMESPACE)
    kind_cluster.apply(sample("smollm2-cpu.yaml", NAMESPACE))
    yield kind_cluster
    kind_cluster.run("-n", NAMESPACE, "delete", "llmd", NAME, "--wait=false")


def llmd(cluster: Cluster) -> dict[str, Any]:
    return cluster.json("-n", NAMESPACE, "get", "llmd", NAME)


def patch(cluster: Cluster, spec: dict[str, Any]) -> None:
    body = json.dumps({"spec": spec})
    cluster.ok("-n", NAMESPACE, "patch", "llmd", NAME, "--type=merge", "-p", body)


def wait_ready(cluster: Cluster, timeout_s: float = 900) -> None:
    def ready() -> bool:
        obj = llmd(cluster)
        status = obj.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return (
            conditions.get("Ready") == "True"
            and status.get("phase") == "Ready"
            and status.get("observedGeneration") == obj["metadata"]["generation"]
        )

    cluster.wait_for(f"llmd/{NAME} Ready", ready, timeout_s)


def chat(
    base_url: str, prompt: str = "Say hello.", max_tokens: int = 16, timeout_s: float = 120
) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def test_the_crd_was_accepted(kind_cluster: Cluster) -> None:
    crd = kind_cluster.json("get", "crd", "llmdeployments.kvfleet.dev")
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established.get("Established") == "True"
    explained = kind_cluster.ok("explain", "llmd.spec.resources")
    assert "<no description>" not in explained


def test_sample_becomes_ready_and_answers(deployed: Cluster) -> None:
    wait_ready(deployed)
    status = llmd(deployed)["status"]
    assert status["endpoint"] == f"http://{NAME}.{NAMESPACE}.svc.cluster.local/v1"
    printed = deployed.ok("-n", NAMESPACE, "get", "llmd", NAME)
    assert "Ready" in printed
    assert "smollm2" in printed
    with deployed.port_forward(NAMESPACE, f"svc/{NAME}", 80) as url:
        assert chat(url).strip()


def test_describe_lists_the_operators_events(deployed: Cluster) -> None:
    described = deployed.ok("-n", NAMESPACE, "describe", "llmd", NAME)
    events = described.split("Events:", 1)[1]
    assert "Created" in events
    assert f"Deployment {NAME}-engine" in events
    assert "<none>" not in events.splitlines()[0]


def test_kubectl_scale_sets_engine_replicas(deployed: Cluster) -> None:
    patch(deployed, {"autoscaling": {"enabled": False}})
    deployed.ok("-n", NAMESPACE, "scale", "llmd", NAME, "--replicas=2")

    def two_ready() -> bool:
        engine = deployed.json("-n", NAMESPACE, "get", "deployment", f"{NAME}-engine")
        return (engine.get("status") or {}).get("availableReplicas") == 2

    deployed.wait_for("2 engine replicas", two_ready, 600)
    wait_ready(deployed)
    assert llmd(deployed)["status"]["readyReplicas"] == 2
    deployed.ok("-n", NAMESPACE, "scale", "llmd", NAME, "--replicas=1")


def test_autoscaler_adds_a_replica_under_load(deployed: Cluster) -> None:
    patch(deployed, {"replicas": 1, "autoscaling": {"enabled": True, "maxReplicas": 2}})
    wait_ready(deployed)
    with (
        deployed.port_forward(NAMESPACE, f"svc/{NAME}", 80) as url,
        concurrent.futures.ThreadPoolExecutor(48) as pool,
    ):
        load = [pool.submit(chat, url, f"Count to {i * 50}.", 200) for i in range(48)]
        deployed.wait_for(
            "the gateway to scale llmd to 2",
            lambda: llmd(deployed)["spec"]["replicas"] == 2,
            300,
        )
        for future in load:
            future.result()


def test_scale_to_zero_and_back_on_a_request(deployed: Cluster) -> None:
    """minReplicas 0: scaled to zero, a request is held while the gateway scales to 1."""
    patch(deployed, {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0}})

    def no_engine() -> bool:
        status = llmd(deployed).get("status") or {}
        return status.get("phase") == "ScaledToZero" and status.get("replicas") == 0

    deployed.wait_for("llmd to scale to zero", no_engine, 300)
    with deployed.port_forward(NAMESPACE, f"svc/{NAME}", 80) as url:
        assert chat(url, timeout_s=600).strip()  # held, not refused, while an engine starts
    assert llmd(deployed)["spec"]["replicas"] == 1
    patch(deployed, {"autoscaling": {"minReplicas": 1}})
    wait_ready(deployed)


def test_spec_change_rolls_out(deployed: Cluster) -> None:
    before = deployed.json("-n", NAMESPACE, "get", "deployment", f"{NAME}-engine")
    patch(deployed, {"engine": {"maxNumSeqs": 16}})

    def rolled() -> bool:
        engine = deployed.json("-n", NAMESPACE, "get", "deployment", f"{NAME}-engine")
        return engine["metadata"]["generation"] > before["metadata"]["generation"]

    deployed.wait_for("the engine Deployment to change", rolled, 120)
    deployed.ok("-n", NAMESPACE, "rollout", "status", f"deployment/{NAME}-engine", timeout=900)
    wait_ready(deployed)
    engines = f"{INSTANCE},app.kubernetes.io/component=engine"
    pods = deployed.json("-n", NAMESPACE, "get", "pods", "-l", engines)
    for pod in pods["items"]:
        assert "--max-num-seqs=16" in pod["spec"]["containers"][0]["args"]
    with deployed.port_forward(NAMESPACE, f"svc/{NAME}", 80) as url:
        assert chat(url).strip()


def test_bad_specs_are_refused_or_fail_with_the_reason(deployed: Cluster) -> None:
    """A quantity Kubernetes cannot parse is refused by the CRD itself; a child the API server
    refuses (here a ResourceQuota allows no Deployment) makes the LLMDeployment Failed with the
    server's message in a condition and a Warning Event, and nothing retries in a loop."""
    bad = sample("smollm2-cpu.yaml", NAMESPACE)
    bad["metadata"]["name"] = "refused"
    bad["spec"]["resources"]["memory"] = "1.2.3Gi"
    refused = deployed.run("apply", "-f", "-", stdin=json.dumps(bad))
    assert refused.returncode != 0
    assert "spec.resources.memory" in refused.stderr

    quota_ns = f"{NAMESPACE}-quota"
    deployed.run("create", "namespace", quota_ns)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-deployments", "namespace": quota_ns},
        "spec": {"hard": {"count/deployments.apps": "0"}},
    }
    deployed.apply(quota)
    deployed.apply(sample("smollm2-cpu.yaml", quota_ns))
    try:

        def failed() -> bool:
            status = deployed.json("-n", quota_ns, "get", "llmd", NAME).get("status") or {}
            return status.get("phase") == "Failed"

        deployed.wait_for("the LLMDeployment to fail", failed, 120)
        status = deployed.json("-n", quota_ns, "get", "llmd", NAME)["status"]
        reasons = {c["type"]: (c["reason"], c["message"]) for c in status["conditions"]}
        assert reasons["SpecValid"][0] == "ChildRejected"
        assert "exceeded quota" in reasons["SpecValid"][1]
        described = deployed.ok("-n", quota_ns, "describe", "llmd", NAME)
        assert "ChildRejected" in described.split("Events:", 1)[1]
    finally:
        deployed.run("delete", "namespace", quota_ns, "--wait=false")


def test_delete_works_with_the_operator_stopped(deployed: Cluster) -> None:
    operator = ("-n", "kvfleet-system", "scale", "deployment", "kvfleet-operator")
    deployed.ok(*operator, "--replicas=0")
    try:
        deployed.ok("-n", NAMESPACE, "delete", "llmd", NAME, "--wait=true", timeout=120)
    finally:
        deployed.ok(*operator, "--replicas=1")


def test_delete_removes_every_child(deployed: Cluster) -> None:
    """Deleted with the operator stopped (above): the garbage collector removes the rest."""
    kinds = "deployments,services,configmaps,serviceaccounts,roles,rolebindings,pdb"

    def gone() -> bool:
        left = deployed.json("-n", NAMESPACE, "get", kinds, "-l", INSTANCE)
        return not left["items"]

    deployed.wait_for("the children to be garbage-collected", gone, 300)
