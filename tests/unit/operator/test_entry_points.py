"""`kvfleet operator` and `kopf run -m kvfleet.operator.main` without a cluster: they start, and
say clearly that no cluster is reachable; the handlers kopf sees are the ones main.py declares."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kopf

from kvfleet.operator import main

NO_KUBECONFIG = "/nonexistent/kubeconfig"


def run(
    repo_root: Path, command: list[str], kubeconfig: str = NO_KUBECONFIG
) -> subprocess.CompletedProcess[str]:
    """`command` from the repository root, out of any cluster, with this kubeconfig."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        cwd=repo_root,
        env={**env, "KUBECONFIG": kubeconfig},
        timeout=120,
    )


KVFLEET_OPERATOR = [sys.executable, "-m", "kvfleet.cli.main", "operator"]


def test_help_needs_no_cluster(repo_root: Path) -> None:
    result = run(repo_root, [*KVFLEET_OPERATOR, "--help"])
    assert result.returncode == 0
    assert "LLMDeployment" in result.stdout


def test_operator_without_kubeconfig_says_no_cluster(repo_root: Path) -> None:
    result = run(repo_root, KVFLEET_OPERATOR)
    assert result.returncode == 2
    assert "no Kubernetes cluster is reachable" in result.stderr
    assert "KUBECONFIG" in result.stderr


def test_operator_with_a_dead_api_server_says_so(repo_root: Path, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )
    result = run(repo_root, KVFLEET_OPERATOR, str(kubeconfig))
    assert result.returncode == 2
    assert "the API server at http://127.0.0.1:9 does not answer" in result.stderr


def test_kopf_entry_point_without_a_cluster_stops_with_the_reason(repo_root: Path) -> None:
    kopf_cli = str(Path(sys.executable).with_name("kopf"))
    result = run(repo_root, [kopf_cli, "run", "--standalone", "-A", "-m", "kvfleet.operator.main"])
    assert result.returncode != 0
    assert "no Kubernetes cluster is reachable" in result.stdout + result.stderr


def test_print_crd_needs_no_cluster(repo_root: Path) -> None:
    result = run(repo_root, [*KVFLEET_OPERATOR, "--print-crd"])
    assert result.returncode == 0
    expected = (repo_root / "crds" / "llmdeployments.kvfleet.dev.yaml").read_text()
    assert result.stdout == expected


def test_handlers_are_registered_for_the_right_resources() -> None:
    # NOTE: kopf's registry has no public listing; these attributes are its own bookkeeping.
    registry = kopf.get_default_registry()

    def watched(handler: object) -> tuple[str | None, str | None, str | None]:
        selector = handler.selector  # type: ignore[attr-defined]
        return selector.group, selector.version, selector.any_name

    changing = list(registry._changing.get_all_handlers())
    assert {h.fn for h in changing} == {main.reconcile}
    assert {watched(h) for h in changing} == {("kvfleet.dev", "v1alpha1", "llmdeployments")}
    # Nothing makes kopf put its finalizer on LLMDeployments (timers and daemons would, and so
    # would a mandatory deletion handler): deleting one must not need the operator running.
    assert list(registry._spawning.get_all_handlers()) == []
    assert not any(h.requires_finalizer for h in changing)
    (watcher,) = registry._watching.get_all_handlers()
    assert watcher.fn is main.child_changed
    assert watched(watcher) == ("apps", "v1", "deployments")
    assert watcher.labels == {"app.kubernetes.io/managed-by": "kvfleet-operator"}
