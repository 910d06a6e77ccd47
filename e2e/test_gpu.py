"""kvfleet on a GPU cluster: an LLMDeployment of Llama-3-8B's shape (random weights, so no hub
token or download is needed) on `nvidia.com/gpu` nodes, tensor parallel across
$KVFLEET_E2E_TP GPUs (default 1), answering through the gateway.

Needs kvfleet installed on the cluster with images the nodes can pull (`e2e/gpu.sh`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import Cluster, sample

pytestmark = pytest.mark.gpu
NAMESPACE = "kvfleet-e2e-gpu"
NAME = "llama-3-8b"


@pytest.fixture(scope="module")
def gpu_cluster(cluster: Cluster) -> Cluster:
    nodes = cluster.json("get", "nodes")["items"]
    gpus = [int(n["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")) for n in nodes]
    if not any(gpus):
        pytest.skip("no node advertises nvidia.com/gpu")
    tensor_parallel = int(os.environ.get("KVFLEET_E2E_TP", "1"))
    if max(gpus) < tensor_parallel:
        pytest.skip(f"no node has {tensor_parallel} GPUs (most: {max(gpus)})")
    if cluster.run("get", "crd", "llmdeployments.kvfleet.dev").returncode != 0:
        pytest.skip("kvfleet is not installed on this cluster: run e2e/gpu.sh install")
    return cluster


@pytest.fixture(scope="module")
def deployed(gpu_cluster: Cluster) -> Iterator[Cluster]:
    obj: dict[str, Any] = sample("llama-3-8b-tp1.yaml", NAMESPACE)
    tensor_parallel = int(os.environ.get("KVFLEET_E2E_TP", "1"))
    spec = obj["spec"]
    spec["model"] = {"source": "llama-3-8b", "loadFormat": "dummy", "servedModelName": NAME}
    spec["engine"]["tensorParallelSize"] = tensor_parallel
    spec["resources"] = {"gpus": tensor_parallel, "memory": "64Gi"}
    spec["replicas"] = 1
    spec["autoscaling"] = {"enabled": False}
    spec["gateway"] = {"replicas": 1}
    gpu_cluster.run("create", "namespace", NAMESPACE)
    gpu_cluster.apply(obj)
    yield gpu_cluster
    gpu_cluster.run("-n", NAMESPACE, "delete", "llmd", NAME, "--wait=true", timeout=300)


def test_gpu_deployment_serves(deployed: Cluster) -> None:
    ready = ("--for=condition=Ready", "--timeout=30m")
    deployed.ok("-n", NAMESPACE, "wait", f"llmd/{NAME}", *ready, timeout=1900)
    engines = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=engine"
    engine = deployed.json("-n", NAMESPACE, "get", "pods", "-l", engines)["items"][0]
    limits = engine["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == os.environ.get("KVFLEET_E2E_TP", "1")
    from openai import OpenAI

    with deployed.port_forward(NAMESPACE, f"svc/{NAME}", 80) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model=NAME, prompt="Hello", max_tokens=16)
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 16
