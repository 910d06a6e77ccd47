"""Replica discovery in a cluster: the ready endpoints of the engine Service's EndpointSlices.

`ready_endpoints` is the pure part (EndpointSlice objects as dicts -> URLs); the watcher runs
the Kubernetes watch in a thread and hands each new URL list to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvfleet.gateway.incluster import api_client_or_in_cluster

logger = logging.getLogger(__name__)


def ready_endpoints(
    slices: Iterable[Mapping[str, Any]], port_name: str | None = None, scheme: str = "http"
) -> list[str]:
    """URLs of the endpoints that are ready (a missing `ready` counts as ready, as the API
    says) and not terminating, on the port named `port_name` (else each slice's first)."""
    urls = set()
    for endpoint_slice in slices:
        ports = endpoint_slice.get("ports") or []
        port = next(
            (p.get("port") for p in ports if port_name is None or p.get("name") == port_name),
            None,
        )
        if port is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.add(f"{scheme}://{host}:{port}")
    return sorted(urls)


class EndpointSliceWatcher:
    """Watches `namespace`'s EndpointSlices of `service`; calls `on_change(urls)` on the loop."""

    def __init__(
        self,
        namespace: str,
        service: str,
        port_name: str | None,
        on_change: Callable[[list[str]], Any],
        loop: asyncio.AbstractEventLoop,
        api_client: Any = None,  # a kubernetes.client.ApiClient; default: the in-cluster one
    ) -> None:
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.api_client = api_client
        self.on_change = on_change
        self.loop = loop
        self._stop = threading.Event()
        self._pending: set[asyncio.Future[Any]] = set()
        self._thread = threading.Thread(target=self._run, name="kvfleet-discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, watch

        self.api_client = api_client_or_in_cluster(self.api_client)
        api = client.DiscoveryV1Api(self.api_client)
        serializer = self.api_client
        selector = f"kubernetes.io/service-name={self.service}"
        backoff = 1.0
        while not self._stop.is_set():
            slices: dict[str, dict[str, Any]] = {}
            try:
                for event in watch.Watch().stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    timeout_seconds=300,
                ):
                    item = serializer.sanitize_for_serialization(event["object"])
                    name = item["metadata"]["name"]
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = item
                    urls = ready_endpoints(slices.values(), self.port_name)
                    self.loop.call_soon_threadsafe(self._publish, urls)
                    if self._stop.is_set():
                        return
                backoff = 1.0
            except Exception as exc:  # the API server went away: watch again after a pause
                logger.warning("EndpointSlice watch failed: %s; retrying", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def _publish(self, urls: list[str]) -> None:
        result = self.on_change(urls)
        if asyncio.iscoroutine(result):
            future = asyncio.ensure_future(result)
            self._pending.add(future)  # NOTE: kept referenced until done
            future.add_done_callback(self._pending.discard)
