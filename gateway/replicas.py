"""ReplicaPool: the engine replicas as the gateway sees them — health, load, adapters, KV events.

Per replica, one task polls `/health`, `/metrics` and `/v1/models`, and one follows `/kv/events`
(a snapshot, then every change) into the shared PrefixIndex; a broken or gapped stream marks the
replica's index stale and reconnects with backoff. `snapshot()` is what routing reads. A replica
that cannot be reached is drained (not ready) until its health check passes again; one that
answers a request with a server error is checked at once and drained only if that check fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvfleet.engine.protocol.kv import BlockHash
from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import ClusterSnapshot, ReplicaId, ReplicaState

logger = logging.getLogger(__name__)

_METRICS = {
    "kvfleet:num_requests_running": "num_running",
    "kvfleet:num_requests_waiting": "num_waiting",
    "kvfleet:kv_cache_usage_perc": "kv_cache_usage",
    "kvfleet:request_success_total": "num_finished",  # summed over finish reasons
}


@dataclass
class Replica:
    replica_id: ReplicaId
    url: str
    state: ReplicaState
    models: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models cards
    events_live: bool = False
    stale_since: float | None = None  # monotonic time the KV event stream was lost


class ReplicaPool:
    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        index: PrefixIndex,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.client = client
        self.index = index
        self.poll_interval_s = poll_interval_s
        self.replicas: dict[ReplicaId, Replica] = {}
        for url in urls:
            replica_id = ReplicaId(url.rstrip("/"))
            state = ReplicaState(replica_id, ready=False)
            self.replicas[replica_id] = Replica(replica_id, url.rstrip("/"), state)
        self._tasks: dict[ReplicaId, list[asyncio.Task[None]]] = {}
        self._started = False
        self.block_size: int | None = None  # the engines' KV block size, from their snapshots

    def start(self) -> None:
        self._started = True
        for replica in self.replicas.values():
            self._start_tasks(replica)

    async def stop(self) -> None:
        for replica_id in list(self._tasks):
            await self._stop_tasks(replica_id)

    async def set_replicas(self, urls: list[str]) -> None:
        """Follow a new set of replica URLs (service discovery): start watching the added ones,
        forget the removed ones and their part of the prefix index."""
        wanted = {ReplicaId(u.rstrip("/")): u.rstrip("/") for u in urls}
        for replica_id in [r for r in self.replicas if r not in wanted]:
            await self._stop_tasks(replica_id)
            del self.replicas[replica_id]
            self.index.remove_replica(replica_id)
            logger.info("replica %s removed", replica_id)
        for replica_id, url in wanted.items():
            if replica_id not in self.replicas:
                replica = Replica(replica_id, url, ReplicaState(replica_id, ready=False))
                self.replicas[replica_id] = replica
                logger.info("replica %s added", url)
                if self._started:
                    self._start_tasks(replica)

    def _start_tasks(self, replica: Replica) -> None:
        self._tasks[replica.replica_id] = [
            asyncio.create_task(self._poll_loop(replica)),
            asyncio.create_task(self._events_loop(replica)),
        ]

    async def _stop_tasks(self, replica_id: ReplicaId) -> None:
        tasks = self._tasks.pop(replica_id, [])
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(tuple(r.state for r in self.replicas.values()))

    def url_of(self, replica_id: ReplicaId) -> str:
        return self.replicas[replica_id].url

    def add_in_flight(self, replica_id: ReplicaId, delta: int) -> None:
        replica = self.replicas[replica_id]
        count = replica.state.num_in_flight + delta
        replica.state = replace(replica.state, num_in_flight=count)

    def drain(self, replica_id: ReplicaId, reason: str) -> None:
        """A request to the replica failed: stop routing to it until its health check passes."""
        replica = self.replicas[replica_id]
        if replica.state.ready:
            logger.warning("replica %s drained: %s", replica.url, reason)
        replica.state = replace(replica.state, ready=False)

    async def recheck(self, replica_id: ReplicaId, reason: str) -> None:
        """A replica answered a server error: poll its health now; drained only if it fails."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        await self._poll(replica)
        if not replica.state.ready:
            logger.warning(
                "replica %s drained: %s and its health check failed", replica.url, reason
            )

    def note_adapter(self, replica_id: ReplicaId, adapter: str) -> None:
        replica = self.replicas[replica_id]
        replica.state = replace(replica.state, adapters=replica.state.adapters | {adapter})

    def forget_adapter(self, adapter: str) -> None:
        """The adapter was unloaded everywhere (until the next poll says otherwise)."""
        for replica in self.replicas.values():
            replica.state = replace(replica.state, adapters=replica.state.adapters - {adapter})
            replica.models = [c for c in replica.models if c.get("id") != adapter]

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the ready replicas' models, first seen first."""
        seen: dict[str, dict[str, Any]] = {}
        for replica in self.replicas.values():
            if replica.state.ready:
                for card in replica.models:
                    seen.setdefault(str(card.get("id")), card)
        return list(seen.values())

    # --- polling -----------------------------------------------------------------------

    async def _poll_loop(self, replica: Replica) -> None:
        while True:
            await self._poll(replica)
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self, replica: Replica) -> None:
        try:
            health = await self.client.get(f"{replica.url}/health", timeout=2.0)
            ready = health.status_code == 200
            load: dict[str, float] = {}
            if ready:
                metrics = await self.client.get(f"{replica.url}/metrics", timeout=2.0)
                load = parse_load(metrics.text)
                models = await self.client.get(f"{replica.url}/v1/models", timeout=2.0)
                replica.models = list(models.json().get("data", []))
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("replica %s: poll failed: %s", replica.url, exc)
            ready, load = False, {}
        adapters = frozenset(str(c["id"]) for c in replica.models if c.get("parent"))
        # NOTE: the in-flight count restarts with each reading, which already counts the
        # requests then in flight; those that end later count -1 each until the next reading.
        replica.state = ReplicaState(
            replica.replica_id,
            ready=ready,
            kv_cache_usage=load.get("kv_cache_usage", 0.0),
            num_running=int(load.get("num_running", 0)),
            num_waiting=int(load.get("num_waiting", 0)),
            num_finished=load.get("num_finished", 0.0),
            num_in_flight=0,
            adapters=adapters if ready else frozenset(),
        )

    # --- KV events -----------------------------------------------------------------------

    async def _events_loop(self, replica: Replica) -> None:
        backoff = 0.2
        while True:
            try:
                await self._follow_events(replica)
                backoff = 0.2
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                logger.debug("replica %s: KV events stopped: %s", replica.url, exc)
            replica.events_live = False
            if replica.stale_since is None:
                replica.stale_since = time.monotonic()
            self.index.mark_stale(replica.replica_id)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _follow_events(self, replica: Replica) -> None:
        async with self.client.stream("GET", f"{replica.url}/kv/events", timeout=None) as stream:
            if stream.status_code != 200:
                raise ValueError(f"/kv/events answered {stream.status_code}")
            async for kind, data in _sse(stream.aiter_lines()):
                if kind == "snapshot":
                    self.block_size = int(data["block_size"])
                    hashes = [BlockHash(bytes.fromhex(b["block_hash"])) for b in data["blocks"]]
                    self.index.load_snapshot(replica.replica_id, hashes, int(data["seq"]))
                    replica.events_live = True
                    replica.stale_since = None
                    continue
                block = data.get("block_hash")
                applied = self.index.apply_event(
                    replica.replica_id,
                    int(data["seq"]),
                    str(data["type"]),
                    BlockHash(bytes.fromhex(block)) if block else None,
                )
                if not applied:
                    raise ValueError("a gap in the KV event sequence: resubscribing")


def parse_load(text: str) -> dict[str, float]:
    """The load gauges from an engine's Prometheus text."""
    load: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = _METRICS.get(name)
        if key is not None:
            load[key] = load.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return load


async def _sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event name, JSON data) from a server-sent event stream."""
    kind, data = "message", ""
    async for line in lines:
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line and data:
            yield kind, json.loads(data)
            kind, data = "message", ""
