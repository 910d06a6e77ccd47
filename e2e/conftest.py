"""Cluster fixtures for e2e tests: a reachable API server through kubectl, or a clean skip."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import pytest

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Cluster:
    """How to reach the cluster under test."""

    kubectl: str
    context: str | None

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        context = ["--context", self.context] if self.context else []
        return subprocess.run(
            [self.kubectl, *context, *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )


@pytest.fixture(scope="session")
def kubectl() -> Kubectl:
    """`kubectl(*args)` against the cluster under test; skips the test when there is none."""
    executable = shutil.which("kubectl")
    if executable is None:
        pytest.skip("no kubectl on PATH: e2e tests need a cluster (see e2e/README.md)")
    found = Cluster(kubectl=executable, context=os.environ.get("KVFLEET_E2E_CONTEXT"))
    try:
        info = found.run("cluster-info", "--request-timeout=10s", timeout=20)
    except subprocess.TimeoutExpired:
        pytest.skip("the Kubernetes API server did not answer within 20 s")
    if info.returncode != 0:
        last_line = (info.stderr.strip().splitlines() or ["kubectl cluster-info failed"])[-1]
        pytest.skip(f"no reachable Kubernetes cluster: {last_line[:200]}")
    return found.run
