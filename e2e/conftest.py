"""Cluster fixtures for e2e tests: a reachable API server through kubectl, or a clean skip."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

Kubectl = Callable[..., subprocess.CompletedProcess[str]]
E2E = Path(__file__).resolve().parent
REPO = E2E.parent


@dataclass(frozen=True)
class Cluster:
    """How to reach the cluster under test."""

    kubectl: str
    context: str | None

    def run(
        self, *args: str, timeout: float = 60, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        context = ["--context", self.context] if self.context else []
        return subprocess.run(
            [self.kubectl, *context, *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            input=stdin,
        )

    def ok(self, *args: str, timeout: float = 60, stdin: str | None = None) -> str:
        """Run kubectl; fail the test with its stderr when it fails."""
        result = self.run(*args, timeout=timeout, stdin=stdin)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def json(self, *args: str) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.ok(*args, "-o", "json"))
        return loaded

    def apply(self, obj: dict[str, Any]) -> None:
        self.ok("apply", "-f", "-", stdin=yaml.safe_dump(obj))

    def wait_for(
        self, what: str, check: Callable[[], bool], timeout_s: float, every_s: float = 5
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(every_s)
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")

    @contextmanager
    def port_forward(self, namespace: str, target: str, port: int) -> Iterator[str]:
        """`kubectl port-forward` to a free local port; yields the base URL."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            local = sock.getsockname()[1]
        context = ["--context", self.context] if self.context else []
        process = subprocess.Popen(
            [self.kubectl, *context, "-n", namespace, "port-forward", target, f"{local}:{port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", local)) == 0:
                        break
                time.sleep(0.2)
            yield f"http://127.0.0.1:{local}"
        finally:
            process.terminate()
            process.wait(10)


def _reachable(cluster: Cluster) -> str | None:
    """None when the API server answers, else why not."""
    try:
        info = cluster.run("cluster-info", "--request-timeout=10s", timeout=20)
    except subprocess.TimeoutExpired:
        return "the Kubernetes API server did not answer within 20 s"
    if info.returncode != 0:
        last_line = (info.stderr.strip().splitlines() or ["kubectl cluster-info failed"])[-1]
        return f"no reachable Kubernetes cluster: {last_line[:200]}"
    return None


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The cluster of the current kubectl context (or $KVFLEET_E2E_CONTEXT); skips without one."""
    executable = shutil.which("kubectl")
    if executable is None:
        pytest.skip("no kubectl on PATH: e2e tests need a cluster (see e2e/README.md)")
    found = Cluster(kubectl=executable, context=os.environ.get("KVFLEET_E2E_CONTEXT"))
    reason = _reachable(found)
    if reason:
        pytest.skip(reason)
    return found


@pytest.fixture(scope="session")
def kubectl(cluster: Cluster) -> Kubectl:
    """`kubectl(*args)` against the cluster under test."""
    return cluster.run


@pytest.fixture(scope="session")
def kind_cluster() -> Cluster:
    """A kind cluster with kvfleet installed from this checkout (`e2e/kind.sh all`), or a skip
    that names what is missing."""
    missing = [tool for tool in ("docker", "kind", "kubectl") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the kind suite needs {', '.join(missing)} on PATH (see e2e/README.md)")
    docker = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if docker.returncode != 0:
        pytest.skip("the docker daemon is not reachable (docker info failed)")
    name = os.environ.get("KVFLEET_KIND_CLUSTER", "kvfleet")
    setup = subprocess.run(
        [str(E2E / "kind.sh"), "all"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert setup.returncode == 0, f"e2e/kind.sh all failed:\n{setup.stdout}\n{setup.stderr}"
    executable = shutil.which("kubectl")
    assert executable is not None
    return Cluster(kubectl=executable, context=f"kind-{name}")


def sample(name: str, namespace: str) -> dict[str, Any]:
    """A sample LLMDeployment from manifests/samples, moved to `namespace`."""
    obj: dict[str, Any] = yaml.safe_load((REPO / "manifests" / "samples" / name).read_text())
    obj["metadata"]["namespace"] = namespace
    return obj
