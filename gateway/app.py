"""create_gateway_app: the OpenAI front door over engine replicas — admit, route, proxy.

A request is authenticated (API key or open mode), charged to its key's rate limits (one
request and prompt + max_tokens tokens, settled with real usage when it ends), routed (see
`routing.policy`), and proxied: the replica's response passes through byte for byte. A
replica that fails before sending a byte is drained and the request tries the next one; a
stream cut mid-way ends with an OpenAI error event and `[DONE]`, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet.engine.core.hashing import BlockHash, extra_keys_for, hash_full_blocks
from kvfleet.engine.protocol import error_body
from kvfleet.engine.server.body_limit import BodyLimitMiddleware
from kvfleet.gateway.admission.keys import KeyStore
from kvfleet.gateway.admission.limiter import ConcurrencyGate, QueueFull, QueueTimeout
from kvfleet.gateway.admission.rate_limit import (
    KeyId,
    KeyLimits,
    RateLimiter,
    Refusal,
    Reservation,
)
from kvfleet.gateway.autoscaler import Autoscaler, KubernetesScaleTarget
from kvfleet.gateway.discovery import EndpointSliceWatcher
from kvfleet.gateway.metrics import GatewayMetrics, GatewayStats
from kvfleet.gateway.replicas import ReplicaPool
from kvfleet.gateway.routing.autoscale import AutoscalePolicy
from kvfleet.gateway.routing.policy import NoReplicaError, route
from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import (
    Policy,
    ReplicaId,
    RouteConfig,
    RouteDecision,
    RouteRequest,
)
from kvfleet.gateway.tokenizer import GatewayTokenizer

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvfleet-replica"  # which replica served the response
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
TOKENIZER_RETRY_S = 10.0
CHAT_DEFAULT_MAX_TOKENS = 512  # reserved when a chat request names no limit


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


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers: dict[str, str] = {}


class _Gateway:
    def __init__(
        self, settings: GatewaySettings, client: httpx.AsyncClient, session: aiohttp.ClientSession
    ) -> None:
        self.settings = settings
        self.client = client  # polling, events, the tokenizer
        self.session = session  # the proxied requests: aiohttp costs a third of httpx per hop
        self.index = PrefixIndex()
        self.pool = ReplicaPool(
            list(settings.replicas), client, self.index, settings.poll_interval_s
        )
        self.limiter = RateLimiter(settings.keys.limits(), settings.default_limits)
        self.config = RouteConfig(settings.policy, settings.max_imbalance)
        self.gate = ConcurrencyGate(
            lambda: settings.max_in_flight_per_replica * len(self.pool.snapshot().ready),
            settings.queue_capacity,
            settings.keys.weights(),
            time.monotonic,
        )
        self.metrics = GatewayMetrics(self.stats)
        self.tokenizer: GatewayTokenizer | None = None
        self._tokenizer_tried_at = -math.inf
        self._round_robin = 0

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
                        self.tokenizer = GatewayTokenizer.from_info(response.json())
                        break
                except Exception as exc:  # routing goes on by load without it
                    logger.warning("could not use the engines' tokenizer: %s", exc)
        return self.tokenizer

    def authenticate(self, request: Request) -> KeyId:
        header = request.headers.get("authorization", "")
        presented = header[7:].strip() if header.lower().startswith("bearer ") else None
        key_id = self.settings.keys.authenticate(presented)
        if key_id is None:
            raise GatewayError(
                401, "invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        return key_id


def create_gateway_app(
    settings: GatewaySettings, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    state: dict[str, _Gateway] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        connector = aiohttp.TCPConnector(limit=4096, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s, connect=5.0)
        async with (
            httpx.AsyncClient(transport=transport, limits=limits, timeout=None) as client,
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        ):
            gateway = _Gateway(settings, client, session)
            state["gateway"] = gateway
            gateway.pool.start()
            watcher = None
            if settings.discover is not None:
                namespace, service, port_name = settings.discover
                watcher = EndpointSliceWatcher(
                    namespace,
                    service,
                    port_name,
                    gateway.pool.set_replicas,
                    asyncio.get_running_loop(),
                )
                watcher.start()
            scaling = None
            if settings.autoscale is not None:
                namespace, name, policy = settings.autoscale
                autoscaler = Autoscaler(
                    policy, KubernetesScaleTarget(namespace, name), gateway.pool.snapshot
                )
                scaling = asyncio.create_task(
                    autoscaler.run(settings.autoscale_interval_s, time.monotonic)
                )
            yield
            if scaling is not None:
                scaling.cancel()
            if watcher is not None:
                watcher.stop()
            await gateway.pool.stop()

    app = FastAPI(title="kvfleet gateway", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        body = error_body(exc.message, exc.type, exc.code)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = state["gateway"].pool.snapshot().ready
        status = 200 if ready else 503
        return JSONResponse({"status": "ok" if ready else "no ready replica"}, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        gateway = state["gateway"]
        cards = gateway.pool.model_cards()
        bases = [c["id"] for c in cards if not c.get("parent")]
        listed = {c["id"] for c in cards}
        cards += [  # adapters the gateway can load, though no replica holds them yet
            {
                "id": name,
                "object": "model",
                "owned_by": "kvfleet",
                "root": path,
                "parent": bases[0] if bases else None,
            }
            for name, path in settings.adapters
            if name not in listed
        ]
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = state["gateway"].metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _observed(state["gateway"], request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _observed(state["gateway"], request, "chat/completions")

    return app


@dataclass
class _Labels:
    """What the metrics of one request are labelled with, filled in as it is read."""

    model: str = ""
    key: str = ""


async def _observed(gateway: _Gateway, request: Request, path: str) -> Response:
    """_handle with the request counted and timed (a stream: when it ends)."""
    began = time.monotonic()
    labels = _Labels()
    metrics = gateway.metrics

    def done(status: int) -> None:
        metrics.requests.labels(labels.model, labels.key, str(status)).inc()
        metrics.latency.labels(labels.model).observe(time.monotonic() - began)

    try:
        response = await _handle(gateway, request, path, labels)
    except GatewayError as exc:
        if exc.status == 429:
            metrics.rate_limited.labels(labels.key).inc()
        done(exc.status)
        raise
    if not isinstance(response, StreamingResponse) or response.status_code != 200:
        done(response.status_code)
        return response

    async def timed(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        last: float | None = None  # when the previous token chunk passed
        try:
            async for chunk in stream:
                if b'"text"' in chunk or b'"content"' in chunk:
                    now = time.monotonic()
                    if last is None:
                        metrics.ttft.labels(labels.model).observe(now - began)
                    else:
                        metrics.itl.labels(labels.model).observe(now - last)
                    last = now
                yield chunk
        finally:
            done(200)

    response.body_iterator = timed(response.body_iterator)  # type: ignore[arg-type]
    return response


async def _handle(gateway: _Gateway, request: Request, path: str, labels: _Labels) -> Response:
    key_id = gateway.authenticate(request)
    labels.key = key_id
    raw = await request.body()
    body = _parse_json(raw)
    model = body.get("model")
    labels.model = model if isinstance(model, str) else ""
    cards = {str(c.get("id")): c for c in gateway.pool.model_cards()}
    if not gateway.pool.snapshot().ready:
        raise GatewayError(503, "no engine replica is ready; retry shortly", "service_unavailable")
    registry = dict(gateway.settings.adapters)
    if not isinstance(model, str) or (model not in cards and model not in registry):
        raise GatewayError(
            404,
            f"the model {model!r} does not exist; served: {sorted(cards)}",
            code="model_not_found",
        )
    adapter = model if model in registry or cards[model].get("parent") else None
    prompt_ids = await _prompt_ids(gateway, body, path)
    max_tokens = _max_tokens(body, path)
    now = time.monotonic()
    reservation = gateway.limiter.reserve(key_id, len(prompt_ids) + max_tokens, now)
    if isinstance(reservation, Refusal):
        error = GatewayError(
            429,
            f"rate limit reached for {reservation.reason}"
            + ("" if math.isfinite(reservation.retry_after_s) else ": the request exceeds it"),
            "rate_limit_exceeded",
            "rate_limit_exceeded",
        )
        if math.isfinite(reservation.retry_after_s):
            error.headers["Retry-After"] = str(max(1, math.ceil(reservation.retry_after_s)))
        raise error
    route_request = _route_request(gateway, request, body, prompt_ids, adapter)
    waited = time.monotonic()
    await _take_slot(gateway, request, key_id, reservation)
    gateway.metrics.queue_wait.observe(time.monotonic() - waited)
    used = 0
    try:
        response, used = await _proxy(gateway, route_request, path, raw, bool(body.get("stream")))
    except BaseException:
        gateway.gate.release()
        gateway.limiter.settle(reservation, used, time.monotonic())
        raise
    if not isinstance(response, StreamingResponse):
        gateway.gate.release()
        gateway.limiter.settle(reservation, used, time.monotonic())
        return response

    async def settle_after(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        generated = 0
        try:
            async for chunk in stream:
                generated += chunk.count(b"data: {")
                yield chunk
        finally:
            gateway.gate.release()
            gateway.limiter.settle(reservation, len(prompt_ids) + generated, time.monotonic())

    response.body_iterator = settle_after(response.body_iterator)  # type: ignore[arg-type]
    return response


def _route_request(
    gateway: _Gateway,
    request: Request,
    body: dict[str, Any],
    prompt_ids: list[int],
    adapter: str | None,
) -> RouteRequest:
    """The prompt's block hashes as the engines make them (block size from the tokenizer or
    the engines' KV snapshots), its adapter and session."""
    block_size = gateway.tokenizer.block_size if gateway.tokenizer else gateway.pool.block_size
    hashes: tuple[BlockHash, ...] = ()
    if block_size:
        keys = extra_keys_for(adapter, body.get("cache_salt"))
        hashes = tuple(hash_full_blocks(prompt_ids, block_size, keys))
    return RouteRequest(hashes, adapter, request.headers.get(gateway.settings.session_header))


async def _take_slot(
    gateway: _Gateway, request: Request, key_id: KeyId, reservation: Reservation
) -> None:
    """Wait for a proxy slot (fair between keys); 503 with Retry-After when there is none."""
    settings = gateway.settings
    try:
        default = settings.keys.priority_of(key_id)
        priority = int(request.headers.get(settings.priority_header, default))
    except ValueError:
        raise GatewayError(400, f"{settings.priority_header} must be an integer") from None
    try:
        await gateway.gate.acquire(key_id, priority, settings.queue_timeout_s)
    except (QueueFull, QueueTimeout) as exc:
        gateway.limiter.settle(reservation, 0, time.monotonic())
        error = GatewayError(503, f"the service is overloaded: {exc}", "service_unavailable")
        error.headers["Retry-After"] = "1"
        raise error from exc
    except BaseException:
        gateway.limiter.settle(reservation, 0, time.monotonic())
        raise


async def _proxy(
    gateway: _Gateway, route_request: RouteRequest, path: str, raw: bytes, stream: bool
) -> tuple[Response, int]:
    """Send to the routed replica; on failure before any byte, drain it and try another."""
    tried: set[ReplicaId] = set()
    last_error = "no engine replica is ready"
    while True:
        decision = _choose(gateway, route_request, tried, last_error)
        replica_id = decision.replica_id
        if decision.load_adapter and route_request.adapter is not None:
            await _load_adapter(gateway, replica_id, route_request.adapter)
        url = f"{gateway.pool.url_of(replica_id)}/v1/{path}"
        gateway.pool.add_in_flight(replica_id, 1)
        gateway.index.record_route(replica_id, route_request.block_hashes)
        try:
            upstream = await gateway.session.post(
                url, data=raw, headers={"content-type": "application/json"}
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            gateway.pool.add_in_flight(replica_id, -1)
            gateway.pool.drain(replica_id, f"{type(exc).__name__}: {exc}")
            last_error = f"the engine replicas failed: {type(exc).__name__}"
            continue
        if upstream.status >= 500 and upstream.status != 503:
            upstream.release()
            gateway.pool.add_in_flight(replica_id, -1)
            gateway.pool.drain(replica_id, f"status {upstream.status}")
            last_error = f"an engine replica answered {upstream.status}"
            continue
        if stream and upstream.status == 200:
            return _stream_through(gateway, replica_id, upstream), 0
        try:
            content = await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            gateway.pool.drain(replica_id, f"{type(exc).__name__}: {exc}")
            raise GatewayError(
                503, "an engine replica failed during the response", "service_unavailable"
            ) from exc
        finally:
            upstream.release()
            gateway.pool.add_in_flight(replica_id, -1)
        used = 0
        if upstream.status == 200:
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                used = int(json.loads(content)["usage"]["total_tokens"])
        media = upstream.headers.get("content-type", "application/json")
        headers = {REPLICA_HEADER: replica_id}
        response = Response(content, upstream.status, headers, media_type=media)
        return response, used


def _choose(
    gateway: _Gateway, route_request: RouteRequest, tried: set[ReplicaId], last_error: str
) -> RouteDecision:
    """The next replica to try (never one tried already); 503 when none is left."""
    try:
        decision = route(
            route_request,
            gateway.pool.snapshot(),
            gateway.index,
            gateway.config,
            gateway._round_robin,
        )
    except NoReplicaError:
        raise GatewayError(503, last_error, "service_unavailable") from None
    gateway._round_robin += 1
    if decision.replica_id in tried:
        raise GatewayError(503, last_error, "service_unavailable")
    tried.add(decision.replica_id)
    metrics = gateway.metrics
    metrics.routes.labels(decision.reason).inc()
    metrics.prefix_blocks.inc(decision.prefix_blocks)
    metrics.prompt_blocks.inc(len(route_request.block_hashes))
    logger.debug(
        "route: %s (%s, %d of %d blocks held)",
        decision.replica_id,
        decision.reason,
        decision.prefix_blocks,
        len(route_request.block_hashes),
    )
    return decision


async def _load_adapter(gateway: _Gateway, replica_id: ReplicaId, adapter: str) -> None:
    """Load a registered adapter onto the replica chosen for it (no replica holds it yet)."""
    path = dict(gateway.settings.adapters).get(adapter)
    if path is None:
        raise GatewayError(
            404, f"the adapter {adapter!r} is loaded nowhere", code="model_not_found"
        )
    url = f"{gateway.pool.url_of(replica_id)}/v1/load_lora_adapter"
    try:
        response = await gateway.client.post(
            url, json={"lora_name": adapter, "lora_path": path}, timeout=120.0
        )
    except httpx.HTTPError as exc:
        raise GatewayError(
            503, f"loading the adapter failed: {exc}", "service_unavailable"
        ) from exc
    message = response.text
    if response.status_code != 200 and "already loaded" not in message:
        raise GatewayError(
            503 if response.status_code >= 500 else 400,
            f"the replica could not load the adapter {adapter!r}: {message[:300]}",
        )
    logger.info("adapter %r loaded on %s", adapter, replica_id)
    gateway.pool.note_adapter(replica_id, adapter)


def _stream_through(
    gateway: _Gateway, replica_id: ReplicaId, upstream: aiohttp.ClientResponse
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            gateway.pool.drain(replica_id, f"stream cut: {type(exc).__name__}")
            error = error_body(
                "the engine replica failed during the response",
                "service_unavailable",
                "replica_failed",
            )
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            upstream.release()
            gateway.pool.add_in_flight(replica_id, -1)

    return StreamingResponse(
        body(),
        status_code=200,
        headers={REPLICA_HEADER: replica_id},
        media_type=upstream.headers.get("content-type", "text/event-stream"),
    )


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise GatewayError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise GatewayError(
            400,
            f"the request body is not valid JSON: {exc.msg} "
            f"at line {exc.lineno} column {exc.colno}",
        ) from exc
    if not isinstance(data, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    return data


async def _prompt_ids(gateway: _Gateway, body: dict[str, Any], path: str) -> list[int]:
    """The first prompt's token ids, for routing and the token reservation (the engine checks
    the request fully; a prompt the gateway cannot read routes by load)."""
    tokenizer = await gateway.tokenizer_for_routing()
    try:
        if path == "chat/completions":
            messages = body.get("messages")
            if tokenizer is None or not isinstance(messages, list):
                return []
            return tokenizer.chat_ids(messages, bool(body.get("add_generation_prompt", True)))
        prompt = first_prompt(body.get("prompt"))
        if isinstance(prompt, list):
            return prompt
        if isinstance(prompt, str) and tokenizer is not None:
            return tokenizer.encode(prompt)
    except (ValueError, TypeError) as exc:
        raise GatewayError(400, str(exc)) from exc
    return []


def first_prompt(prompt: Any) -> str | list[int] | None:
    """The first prompt of a completions request: a string, token ids, or a batch of either."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    return None


def _max_tokens(body: dict[str, Any], path: str) -> int:
    default = (
        CHAT_DEFAULT_MAX_TOKENS if path == "chat/completions" else COMPLETIONS_DEFAULT_MAX_TOKENS
    )
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    n = body.get("n") or 1
    if not isinstance(value, int) or not isinstance(n, int) or value < 0 or n < 1:
        return default  # the engine answers 400 with the details
    return value * n
