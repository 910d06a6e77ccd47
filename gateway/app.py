"""create_gateway_app: the OpenAI front door over engine replicas — admit, route, proxy.

A request is authenticated (API key or open mode), charged to its key's rate limits (one
request and prompt + max_tokens tokens, settled with real usage when it ends), routed (see
`routing.policy`), and proxied: the replica's response passes through byte for byte. A
replica that fails before sending a byte is drained and the request tries the next one; a
stream cut mid-way ends with an OpenAI error event and `[DONE]`, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet.engine.protocol.http import (
    CLIENT_CLOSED,
    APIError,
    BodyLimitMiddleware,
    ClientGone,
    api_error_response,
    unless_disconnected,
)
from kvfleet.engine.protocol.kv import BlockHash, extra_keys_for, hash_full_blocks
from kvfleet.engine.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    openapi_body,
)
from kvfleet.gateway.adapters import add_adapter_routes
from kvfleet.gateway.admission.limiter import QueueFull, QueueTimeout
from kvfleet.gateway.admission.rate_limit import KeyId, Refusal, Reservation
from kvfleet.gateway.cluster import ClusterLoops
from kvfleet.gateway.peers import USAGE_PATH, usage_body
from kvfleet.gateway.proxy import REPLICA_HEADER, proxy
from kvfleet.gateway.requests import count_prompts, read_request
from kvfleet.gateway.routing.snapshot import RouteRequest
from kvfleet.gateway.state import Gateway, GatewaySettings

__all__ = ["REPLICA_HEADER", "GatewaySettings", "create_gateway_app"]

logger = logging.getLogger(__name__)


def create_gateway_app(
    settings: GatewaySettings,
    transport: httpx.AsyncBaseTransport | None = None,
    kube_api_client: Any = None,
) -> FastAPI:
    """The gateway app; `transport` (engines) and `kube_api_client` (the Kubernetes API, in
    cluster mode) are tests' stand-ins, by default the network and the pod's account."""
    state: dict[str, Gateway] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        connector = aiohttp.TCPConnector(limit=4096, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s, connect=5.0)
        async with (
            httpx.AsyncClient(transport=transport, limits=limits, timeout=None) as client,
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        ):
            gateway = Gateway(settings, client, session)
            state["gateway"] = gateway
            gateway.pool.start()
            loops = ClusterLoops.start(gateway, kube_api_client)
            yield
            loops.stop()
            gateway.bodies.close()
            await gateway.pool.stop()

    app = FastAPI(title="kvfleet gateway", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    app.add_exception_handler(APIError, api_error_response)

    @app.api_route("/health", methods=["GET", "HEAD"])
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
            for name, path in gateway.adapters.items()
            if name not in listed
        ]
        return {"object": "list", "data": cards}

    add_adapter_routes(app, state)

    @app.get(USAGE_PATH)
    async def usage() -> dict[str, Any]:
        """What this pod charged each key (read by its peers; the same per-key traffic
        `/metrics` shows, so nothing new is exposed)."""
        gateway = state["gateway"]
        return usage_body(gateway.peer_sync.instance, gateway.limiter)

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = state["gateway"].metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _observed(state["gateway"], request, "completions")

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _observed(state["gateway"], request, "chat/completions")

    return app


@dataclass
class _Labels:
    """What the metrics of one request are labelled with, filled in as it is read."""

    model: str = ""
    key: str = ""


async def _observed(gateway: Gateway, request: Request, path: str) -> Response:
    """_handle with the request counted and timed (a stream: when it ends)."""
    began = time.monotonic()
    labels = _Labels()
    metrics = gateway.metrics

    def done(status: int) -> None:
        metrics.requests.labels(labels.model, labels.key, str(status)).inc()
        metrics.latency.labels(labels.model).observe(time.monotonic() - began)

    try:
        response = await _handle(gateway, request, path, labels)
    except APIError as exc:
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


async def _handle(gateway: Gateway, request: Request, path: str, labels: _Labels) -> Response:
    key_id = gateway.authenticate(request)
    labels.key = key_id
    raw = await request.body()
    counted_by = gateway.tokenizer
    body, counted, new_tokens = await gateway.bodies.run(len(raw), read_request, raw, path)
    model = body.get("model")
    labels.model = model if isinstance(model, str) else ""
    if not gateway.pool.snapshot().ready:
        if gateway.activator is None:
            raise APIError(503, "no engine replica is ready; retry shortly", "service_unavailable")
        await gateway.activator.wait_for_replica()  # scaled to zero, or engines starting
    adapter = _adapter_named(gateway, model)
    if counted_by is None and await gateway.tokenizer_for_routing() is not None:
        counted = await gateway.bodies.run(len(raw), count_prompts, raw, path)  # exactly now
    prompt_ids, prompt_tokens, prompts = counted
    # every token the request can cause: all its prompts, and max_tokens for each of their n
    max_tokens = new_tokens * prompts
    priority = _priority(gateway, request, key_id, body)
    reservation = _reserve(gateway, key_id, prompt_tokens + max_tokens)
    route_request = _route_request(gateway, request, body, prompt_ids, adapter)
    waited = time.monotonic()
    await _take_slot(gateway, key_id, priority, reservation)
    gateway.metrics.queue_wait.observe(time.monotonic() - waited)
    used = 0
    try:
        stream = bool(body.get("stream"))
        forwarded = proxy(gateway, route_request, path, raw, stream)
        # a stream stops when its client does; a whole answer is abandoned (the engine aborts)
        response, used = await (forwarded if stream else unless_disconnected(request, forwarded))
    except ClientGone:
        # The engine worked on it until the abort, how far is unknown: the whole reservation
        # stays charged, so leaving just before the answer never makes a request free.
        gateway.gate.release()
        gateway.limiter.settle(reservation, reservation.tokens, time.monotonic())
        return Response(status_code=CLIENT_CLOSED)
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
            gateway.limiter.settle(reservation, prompt_tokens + generated, time.monotonic())

    response.body_iterator = settle_after(response.body_iterator)  # type: ignore[arg-type]
    return response


def _reserve(gateway: Gateway, key_id: KeyId, tokens: int) -> Reservation:
    """The key's request and `tokens`, or 429 with Retry-After (none: it can never fit)."""
    reservation = gateway.limiter.reserve(key_id, tokens, time.monotonic())
    if isinstance(reservation, Refusal):
        error = APIError(
            429,
            f"rate limit reached for {reservation.reason}"
            + ("" if math.isfinite(reservation.retry_after_s) else ": the request exceeds it"),
            "rate_limit_exceeded",
            "rate_limit_exceeded",
        )
        if math.isfinite(reservation.retry_after_s):
            error.headers["Retry-After"] = str(max(1, math.ceil(reservation.retry_after_s)))
        raise error
    return reservation


def _route_request(
    gateway: Gateway,
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


def _priority(gateway: Gateway, request: Request, key_id: KeyId, body: dict[str, Any]) -> int:
    """The request's queue priority: the header's, else the key's. Neither the header nor the
    body's `priority` (the engine's) may be more urgent than the key's ceiling: 400 otherwise,
    so a tenant cannot starve the others."""
    keys, header = gateway.settings.keys, gateway.settings.priority_header
    try:
        priority = int(request.headers.get(header, keys.priority_of(key_id)))
    except ValueError:
        raise APIError(400, f"{header} must be an integer") from None
    ceiling = keys.ceiling_of(key_id)
    for where, value in ((header, priority), ("priority", body.get("priority", ceiling))):
        if ceiling is not None and value is not None and value < ceiling:
            raise APIError(
                400,
                f"{where} {value} is more urgent than this API key may ask for (at most "
                f"{ceiling}; larger values are less urgent)",
            )
    return priority


async def _take_slot(
    gateway: Gateway, key_id: KeyId, priority: int, reservation: Reservation
) -> None:
    """Wait for a proxy slot (fair between keys); 503 with Retry-After when there is none."""
    settings = gateway.settings
    try:
        await gateway.gate.acquire(key_id, priority, settings.queue_timeout_s)
    except (QueueFull, QueueTimeout) as exc:
        gateway.limiter.settle(reservation, 0, time.monotonic())
        error = APIError(503, f"the service is overloaded: {exc}", "service_unavailable")
        error.headers["Retry-After"] = "1"
        raise error from exc
    except BaseException:
        gateway.limiter.settle(reservation, 0, time.monotonic())
        raise


def _adapter_named(gateway: Gateway, model: object) -> str | None:
    """The LoRA adapter a request's `model` names (None: a base model); 404 if nothing is."""
    cards = {str(c.get("id")): c for c in gateway.pool.model_cards()}
    registry = gateway.adapters
    if not isinstance(model, str) or (model not in cards and model not in registry):
        raise APIError(
            404,
            f"the model {model!r} does not exist; served: {sorted(cards)}",
            code="model_not_found",
        )
    return model if model in registry or cards[model].get("parent") else None
