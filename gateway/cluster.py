"""The gateway's background parts beyond its replicas, started with the app and stopped with
it: the engines' EndpointSlices followed, the autoscaler elected with a Lease, scale from zero,
and the per-key usage exchanged with the other gateway pods."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvfleet.gateway.activation import Activator
from kvfleet.gateway.autoscaler import Autoscaler, KubernetesScaleTarget
from kvfleet.gateway.discovery import EndpointSliceWatcher
from kvfleet.gateway.incluster import api_client_or_in_cluster
from kvfleet.gateway.leader import KubernetesLeaseStore, LeaderElector, autoscaler_lease_name
from kvfleet.gateway.state import Gateway


@dataclass
class ClusterLoops:
    watcher: EndpointSliceWatcher | None = None
    peers: EndpointSliceWatcher | None = None  # the other gateway pods
    elector: LeaderElector | None = None
    autoscaler: Autoscaler | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    def start(cls, gateway: Gateway, api_client: Any = None) -> ClusterLoops:
        """What the settings ask for (nothing outside a cluster). `api_client`: tests' client;
        default: the pod's service account."""
        settings, loops = gateway.settings, cls()
        if settings.peers or settings.peers_service:
            loops.tasks.append(asyncio.create_task(gateway.peer_sync.run()))
        if settings.discover is None and settings.autoscale is None:
            return loops
        api_client = api_client_or_in_cluster(api_client)
        if settings.discover is not None:
            namespace, service, port_name = settings.discover
            loops.watcher = EndpointSliceWatcher(
                namespace,
                service,
                port_name,
                gateway.pool.set_replicas,
                asyncio.get_running_loop(),
                api_client,
            )
            loops.watcher.start()
            if settings.peers_service is not None:

                def follow(urls: list[str]) -> None:
                    gateway.peer_urls = urls

                loops.peers = EndpointSliceWatcher(
                    namespace,
                    settings.peers_service,
                    "http",
                    follow,
                    asyncio.get_running_loop(),
                    api_client,
                )
                loops.peers.start()
        if settings.autoscale is not None:
            namespace, name, policy = settings.autoscale
            lease = KubernetesLeaseStore(namespace, autoscaler_lease_name(name), api_client)
            elector = LeaderElector(lease, settings.identity)
            target = KubernetesScaleTarget(namespace, name, api_client)
            autoscaler = Autoscaler(
                policy, target, gateway.pool.snapshot, lambda: elector.is_leader
            )
            loops.elector, loops.autoscaler = elector, autoscaler
            loops.tasks += [
                asyncio.create_task(elector.run()),
                asyncio.create_task(autoscaler.run(settings.autoscale_interval_s, time.monotonic)),
            ]
            gateway.activator = Activator(
                target,
                lambda: bool(gateway.pool.snapshot().ready),
                settings.queue_capacity,
                settings.activation_timeout_s,
            )
        return loops

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for watcher in (self.watcher, self.peers):
            if watcher is not None:
                watcher.stop()
