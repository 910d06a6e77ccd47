"""The cluster under test answers and can run the objects kvfleet creates."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def test_api_server_serves_the_apis_kvfleet_uses(kubectl: Kubectl) -> None:
    result = kubectl("api-resources", "-o", "name")
    assert result.returncode == 0, result.stderr
    names = set(result.stdout.split())
    for resource in (
        "deployments.apps",
        "services",
        "poddisruptionbudgets.policy",
        "endpointslices.discovery.k8s.io",
        "customresourcedefinitions.apiextensions.k8s.io",
    ):
        assert resource in names


def test_nodes_are_ready(kubectl: Kubectl) -> None:
    result = kubectl("get", "nodes", "-o", "json")
    assert result.returncode == 0, result.stderr
    nodes = json.loads(result.stdout)["items"]
    assert nodes, "the cluster has no nodes"
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}.get("Ready")
        assert ready == "True", node["metadata"]["name"]
