"""The gateway's settings and shared state: replicas, index, limits, queue, metrics, tokenizer."""

from __future__ import annotations

import functools
import logging
import math
import socket
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
from fastapi import Request

from kvfleet.engine.protocol.body_work import BodyWork
from kvfleet.engine.protocol.http import APIError
from kvfleet.gateway.activation import Activator
from kvfleet.gateway.admission.keys import KeyStore
from kvfleet.gateway.admission.limiter import ConcurrencyGate
from kvfleet.gateway.admission.rate_limit import KeyId, KeyLimits, RateLimiter
from kvfleet.gateway.metrics import GatewayMetrics, GatewayStats
from kvfleet.gateway.peers import PeerSync
from kvfleet.gateway.replicas import ReplicaPool
from kvfleet.gateway.routing.autoscale import AutoscalePolicy
from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import Policy, RouteConfig
from kvfleet.gateway.tokenizer import GatewayTokenizer

logger = logging.getLogger(__name__)

TOKENIZER_RETRY_S = 10.0


@dataclass(frozen=True)
class GatewaySettings:
    replicas: tuple[str, ...]
    policy: Policy = Policy.PREFIX
    max_imbalance: float = 8.0
    keys: KeyStore = field(default_factory=lambda: KeyStore([]))
    default_limits: KeyLimits = field(default_factory=KeyLimits)
    max_body_bytes: int = 8 << 20
    session_header: str = "x-session-id"
    poll_interval_s: float = 0.5
    request_timeout_s: float = 600.0
    # Requests proxied at once per ready replica; beyond, they wait in the fair queue.
    max_in_flight_per_replica: int = 256
    queue_capacity: int = 4096
    queue_timeout_s: float = 60.0
    priority_header: str = "x-priority"  # lower goes first, as the engine's priority
    # LoRA adapters the gateway may load onto a replica (name -> folder on the engines' disk)
    adapters: tuple[tuple[str, str], ...] = ()
    # Cluster mode: follow the ready endpoints of this Service (namespace, name, port name)
    discover: tuple[str, str, str | None] | None = None
    # Cluster mode: scale this LLMDeployment (namespace, name) with this policy
    autoscale: tuple[str, str, AutoscalePolicy] | None = None
    autoscale_interval_s: float = 15.0
    # Scaled to zero (or engines starting): how long a request waits for a ready engine
    activation_timeout_s: float = 300.0
    # Start the process that reads large request bodies once the tokenizer is known, not on
    # first need (the gateway command does; tests leave it to the first large body).
    prestart_body_worker: bool = False
    # Other gateway pods sharing the per-key limits: their URLs, or (k8s) the gateway's own
    # Service, whose ready endpoints are followed
    peers: tuple[str, ...] = ()
    peers_service: str | None = None
    peer_sync_interval_s: float = 1.0
    # This pod's name in the autoscaler's leader election
    identity: str = field(default_factory=socket.gethostname)


class Gateway:
    def __init__(
        self, settings: GatewaySettings, client: httpx.AsyncClient, session: aiohttp.ClientSession
    ) -> None:
        self.settings = settings
        # LoRA adapters the gateway may load onto a replica: the configured ones, and those
        # loaded at runtime (/v1/load_lora_adapter)
        self.adapters: dict[str, str] = dict(settings.adapters)
        self.client = client  # polling, events, the tokenizer
        self.session = session  # the proxied requests: aiohttp costs a third of httpx per hop
        self.index = PrefixIndex()
        self.pool = ReplicaPool(
            list(settings.replicas), client, self.index, settings.poll_interval_s
        )
        self.limiter = RateLimiter(
            settings.keys.limits(),
            settings.default_limits,
            self.sharing_pods,
            settings.peer_sync_interval_s,
        )
        self.peer_urls: list[str] = list(settings.peers)  # k8s: followed from the Service
        self.peer_sync = PeerSync(
            self.limiter,
            client,
            lambda: self.peer_urls,
            interval_s=settings.peer_sync_interval_s,
        )
        self.config = RouteConfig(settings.policy, settings.max_imbalance)
        self.gate = ConcurrencyGate(
            lambda: settings.max_in_flight_per_replica * len(self.pool.snapshot().ready),
            settings.queue_capacity,
            settings.keys.weights(),
            time.monotonic,
        )
        self.metrics = GatewayMetrics(self.stats)
        self.tokenizer: GatewayTokenizer | None = None
        # Where request bodies are read and their tokens counted (a worker process for large
        # ones, which makes its own tokenizer from the same engine's description).
        self.bodies: BodyWork[GatewayTokenizer] = BodyWork(
            None, None, settings.prestart_body_worker
        )
        self._tokenizer_tried_at = -math.inf
        self.round_robin = 0
        self.activator: Activator | None = None  # cluster mode with autoscaling

    def sharing_pods(self) -> int:
        """Gateway pods holding the per-key limits together (1 without peers)."""
        return self.peer_sync.count()

    def stats(self) -> GatewayStats:
        now = time.monotonic()
        replicas = [
            (
                r.url,
                r.state.ready,
                r.events_live,
                0.0 if r.stale_since is None else now - r.stale_since,
            )
            for r in self.pool.replicas.values()
        ]
        return GatewayStats(len(self.gate.queue), self.gate.in_flight, replicas)

    async def tokenizer_for_routing(self) -> GatewayTokenizer | None:
        """The engines' tokenizer, fetched once from a ready replica (None until one is; tried
        again at most every TOKENIZER_RETRY_S, so requests never wait on it in a loop)."""
        now = time.monotonic()
        if self.tokenizer is None and now - self._tokenizer_tried_at >= TOKENIZER_RETRY_S:
            self._tokenizer_tried_at = now
            for replica in self.pool.snapshot().ready:
                try:
                    response = await self.client.get(
                        f"{self.pool.url_of(replica.replica_id)}/tokenizer", timeout=30.0
                    )
                    if response.status_code == 200:
                        info = response.json()
                        self.tokenizer = GatewayTokenizer.from_info(info)
                        load = functools.partial(GatewayTokenizer.from_info, info)
                        self.bodies.use(self.tokenizer, load)
                        break
                except Exception as exc:  # routing goes on by load without it
                    logger.warning("could not use the engines' tokenizer: %s", exc)
        return self.tokenizer

    def authenticate(self, request: Request) -> KeyId:
        header = request.headers.get("authorization", "")
        presented = header[7:].strip() if header.lower().startswith("bearer ") else None
        key_id = self.settings.keys.authenticate(presented)
        if key_id is None:
            raise APIError(
                401, "invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        return key_id
