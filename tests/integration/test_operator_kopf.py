"""The operator as it runs in the cluster: kopf itself, with the operator's handlers, against the
strict fake API server (RBAC of manifests/operator enforced) over real HTTP."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

import kvfleet.operator.main  # noqa: F401  (registers the handlers, as `kvfleet operator` does)

from ..unit.operator.conftest import SPEC
from ..unit.operator.fake_kube import FakeKube, running

LLMD = ("/apis/kvfleet.dev/v1alpha1", "llmdeployments")
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"  # what operators before 0.2 left


def _kubeconfig(path: Path, url: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "operator", "user": {"token": "operator"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "operator"}}],
        "current-context": "fake",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def operator(namespaces: list[str]) -> Iterator[None]:
    """kopf running the operator in a thread until the block ends."""
    stop: asyncio.Future[None] | None = None
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        nonlocal stop
        loop = asyncio.new_event_loop()
        stop = loop.create_future()
        ready.set()
        try:
            loop.run_until_complete(
                kopf.operator(
                    standalone=True,
                    clusterwide=not namespaces,
                    namespaces=namespaces,
                    memo=kopf.Memo(namespaces=namespaces),
                    stop_flag=stop,
                )
            )
        except BaseException as exc:
            failure.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield
    finally:
        assert stop is not None
        if thread.is_alive():
            flag = stop
            flag.get_loop().call_soon_threadsafe(lambda: flag.done() or flag.set_result(None))
        thread.join(30)
        assert not thread.is_alive(), "kopf did not stop"
        assert not failure, failure


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _llmd(name: str, namespace: str, finalizers: list[str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if finalizers:
        meta["finalizers"] = finalizers
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": meta,
        "spec": copy.deepcopy(SPEC),
    }


def test_namespaced_operator_needs_no_more_rbac_and_deletion_needs_no_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeKube()
    fake.create(*LLMD, _llmd("chat", "llm"))
    fake.create(*LLMD, _llmd("older", "llm", finalizers=[KOPF_FINALIZER]))
    fake.create(*LLMD, _llmd("other", "elsewhere"))
    with running(fake) as url:
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kubeconfig", url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        with operator(["llm"]):
            _wait(
                "the engine Deployment",
                lambda: fake.get("/apis/apps/v1", "deployments", "llm", "chat-engine") is not None,
            )
            _wait(
                "kopf to drop the finalizer an older operator left",
                lambda: not fake.objects[(*LLMD, "llm", "older")]["metadata"].get("finalizers"),
            )
            _wait("the status", lambda: "status" in fake.objects[(*LLMD, "llm", "chat")])
            _wait("Events", lambda: len(fake.events_for("chat")) >= 9)
        assert fake.denied == []  # not one 403 (each cost kopf a backoff: ~55 s at start)
        listed = [p for _, p in fake.requests if p.split("?")[0] == "/api/v1/namespaces"]
        assert listed == []  # namespaced mode never lists or watches namespaces
        assert fake.get("/apis/apps/v1", "deployments", "elsewhere", "other-engine") is None
        chat = fake.objects[(*LLMD, "llm", "chat")]
        assert not chat["metadata"].get("finalizers")
        assert chat["status"]["phase"] == "Pending"
        # the operator is stopped: `kubectl delete llmd/chat` completes, and the garbage
        # collector removes the children
        fake.delete((*LLMD, "llm", "chat"))
        assert (*LLMD, "llm", "chat") not in fake.objects
        left = [k for k in fake.objects if k[2] == "llm" and k[1] != "events"]
        assert left  # the other object and its children stay
        assert all(name.startswith("older") for _, _, _, name in left)
