"""The gateway's cluster-mode loops against a small in-process fake of the Kubernetes API:
EndpointSlice watch -> replica URLs, and the LLMDeployment scale subresource read and patched."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvfleet.gateway.autoscaler import KubernetesScaleTarget
from kvfleet.gateway.discovery import EndpointSliceWatcher

from .test_gateway_admission import serve

kubernetes = pytest.importorskip("kubernetes")


def endpoint_slice(name: str, addresses: list[tuple[str, bool]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "labels": {"kubernetes.io/service-name": "engines"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8100, "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a, ready in addresses],
    }


def fake_api() -> tuple[FastAPI, dict[str, Any]]:
    app = FastAPI()
    seen: dict[str, Any] = {"selector": None, "patches": [], "replicas": 2}

    @app.get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices")
    async def slices(namespace: str, request: Request) -> StreamingResponse:
        seen["selector"] = request.query_params.get("labelSelector")
        events = [
            ("ADDED", endpoint_slice("engines-a", [("10.0.0.1", True), ("10.0.0.2", False)])),
            ("MODIFIED", endpoint_slice("engines-a", [("10.0.0.1", True), ("10.0.0.2", True)])),
            ("ADDED", endpoint_slice("engines-b", [("10.0.0.3", True)])),
            ("DELETED", endpoint_slice("engines-a", [])),
        ]

        async def stream() -> AsyncIterator[bytes]:
            for kind, obj in events:
                yield (json.dumps({"type": kind, "object": obj}) + "\n").encode()
                await asyncio.sleep(0.05)
            await asyncio.sleep(3600)

        return StreamingResponse(stream(), media_type="application/json")

    scale_path = "/apis/kvfleet.dev/v1alpha1/namespaces/{namespace}/llmdeployments/{name}/scale"

    @app.get(scale_path)
    async def get_scale(namespace: str, name: str) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "spec": {"replicas": seen["replicas"]},
        }

    @app.patch(scale_path)
    async def patch_scale(namespace: str, name: str, request: Request) -> dict[str, Any]:
        body = await request.json()
        seen["patches"].append(((namespace, name), request.headers["content-type"], body))
        seen["replicas"] = body["spec"]["replicas"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "spec": {"replicas": seen["replicas"]},
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app, seen


def api_client(url: str) -> Any:
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    return kubernetes.client.ApiClient(configuration)


def test_endpoint_slice_watch_follows_ready_endpoints() -> None:
    app, seen = fake_api()
    with serve(app) as url:
        updates: list[list[str]] = []
        done = threading.Event()

        async def run() -> None:
            loop = asyncio.get_running_loop()

            def on_change(urls: list[str]) -> None:
                updates.append(urls)
                if len(updates) == 4:
                    done.set()

            watcher = EndpointSliceWatcher(
                "llm", "engines", "http", on_change, loop, api_client(url)
            )
            watcher.start()
            for _ in range(100):
                if done.is_set():
                    break
                await asyncio.sleep(0.05)
            watcher.stop()

        asyncio.run(run())
    assert seen["selector"] == "kubernetes.io/service-name=engines"
    assert updates == [
        ["http://10.0.0.1:8100"],
        ["http://10.0.0.1:8100", "http://10.0.0.2:8100"],
        ["http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.3:8100"],
        ["http://10.0.0.3:8100"],
    ]


def test_scale_subresource_is_read_and_patched() -> None:
    app, seen = fake_api()
    with serve(app) as url:
        target = KubernetesScaleTarget("llm", "chat", api_client(url))
        assert target.get_replicas() == 2
        target.set_replicas(5)
        assert target.get_replicas() == 5
    ((where, content_type, body),) = seen["patches"]
    assert where == ("llm", "chat")
    assert content_type.startswith("application/merge-patch+json")
    assert body == {"spec": {"replicas": 5}}
