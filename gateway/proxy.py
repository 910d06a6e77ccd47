"""The hop to a replica: route, send, pass the answer through; drain and retry on failure.

A replica that cannot be reached is drained and the request tries the next one. One that
answers 5xx (not 503) is asked for its health at once and drained only if that fails: a
request can make a replica answer 500 without the replica being sick, and one bad request
must not take replicas out of rotation. A stream cut mid-way ends with an OpenAI error event
and `[DONE]`, never a hang. 4xx answers (the request's own fault) pass through untouched.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import httpx
from fastapi.responses import Response, StreamingResponse

from kvfleet.engine.protocol.http import APIError, error_body
from kvfleet.gateway.routing.policy import NoReplicaError, route
from kvfleet.gateway.routing.snapshot import ReplicaId, RouteDecision, RouteRequest
from kvfleet.gateway.state import Gateway

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvfleet-replica"  # which replica served the response


async def proxy(
    gateway: Gateway, route_request: RouteRequest, path: str, raw: bytes, stream: bool
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
            await gateway.pool.recheck(replica_id, f"it answered {upstream.status}")
            last_error = f"an engine replica answered {upstream.status}"
            continue
        if stream and upstream.status == 200:
            return _stream_through(gateway, replica_id, upstream), 0
        try:
            content = await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            gateway.pool.drain(replica_id, f"{type(exc).__name__}: {exc}")
            raise APIError(
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
    gateway: Gateway, route_request: RouteRequest, tried: set[ReplicaId], last_error: str
) -> RouteDecision:
    """The next replica to try (never one tried already); 503 when none is left."""
    try:
        decision = route(
            route_request,
            gateway.pool.snapshot(),
            gateway.index,
            gateway.config,
            gateway.round_robin,
        )
    except NoReplicaError:
        raise APIError(503, last_error, "service_unavailable") from None
    gateway.round_robin += 1
    if decision.replica_id in tried:
        raise APIError(503, last_error, "service_unavailable")
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


async def _load_adapter(gateway: Gateway, replica_id: ReplicaId, adapter: str) -> None:
    """Load a registered adapter onto the replica chosen for it (no replica holds it yet)."""
    path = gateway.adapters.get(adapter)
    if path is None:
        raise APIError(404, f"the adapter {adapter!r} is loaded nowhere", code="model_not_found")
    url = f"{gateway.pool.url_of(replica_id)}/v1/load_lora_adapter"
    try:
        response = await gateway.client.post(
            url, json={"lora_name": adapter, "lora_path": path}, timeout=120.0
        )
    except httpx.HTTPError as exc:
        raise APIError(503, f"loading the adapter failed: {exc}", "service_unavailable") from exc
    message = response.text
    if response.status_code != 200 and "already loaded" not in message:
        raise APIError(
            503 if response.status_code >= 500 else 400,
            f"the replica could not load the adapter {adapter!r}: {message[:300]}",
        )
    logger.info("adapter %r loaded on %s", adapter, replica_id)
    gateway.pool.note_adapter(replica_id, adapter)


def _stream_through(
    gateway: Gateway, replica_id: ReplicaId, upstream: aiohttp.ClientResponse
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
