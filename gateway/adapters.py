"""LoRA adapters loaded and unloaded at runtime through the gateway, as on an engine:
`POST /v1/load_lora_adapter` registers the adapter and loads it on every ready replica (so a
bad folder is refused at once, with the engine's reason); requests naming it then route as to
any adapter, and a replica that starts later loads it on its first such request.
`POST /v1/unload_lora_adapter` unloads it everywhere and forgets it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI, Request

from kvfleet.engine.protocol.http import APIError
from kvfleet.engine.protocol.openai import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    openapi_body,
    parse_json_object,
    validate_request,
)
from kvfleet.gateway.state import Gateway


def add_adapter_routes(app: FastAPI, state: dict[str, Gateway]) -> None:
    @app.post("/v1/load_lora_adapter", openapi_extra=openapi_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        gateway = state["gateway"]
        gateway.authenticate(request)
        body = _read(await request.body(), LoadLoRAAdapterRequest)
        if body.lora_name in gateway.adapters:
            raise APIError(400, f"the adapter {body.lora_name!r} is already loaded")
        payload = body.model_dump()
        answers = await _on_every_ready_replica(gateway, "/v1/load_lora_adapter", payload)
        refused = [a for a in answers if a.status_code != 200 and "already loaded" not in a.text]
        if refused:  # (the engines refuse alike: one reason says it)
            await _on_every_ready_replica(
                gateway, "/v1/unload_lora_adapter", {"lora_name": body.lora_name}
            )
            raise APIError(
                refused[0].status_code if refused[0].status_code < 500 else 503,
                _message(refused[0]),
            )
        gateway.adapters[body.lora_name] = body.lora_path
        for replica in gateway.pool.snapshot().replicas:
            if replica.ready:
                gateway.pool.note_adapter(replica.replica_id, body.lora_name)
        return {"status": "ok", "lora_name": body.lora_name, "replicas": len(answers)}

    @app.post("/v1/unload_lora_adapter", openapi_extra=openapi_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        gateway = state["gateway"]
        gateway.authenticate(request)
        body = _read(await request.body(), UnloadLoRAAdapterRequest)
        held = any(body.lora_name in r.adapters for r in gateway.pool.snapshot().replicas)
        if body.lora_name not in gateway.adapters and not held:
            raise APIError(
                404, f"no adapter named {body.lora_name!r} is loaded", code="model_not_found"
            )
        gateway.adapters.pop(body.lora_name, None)
        payload = {"lora_name": body.lora_name}
        answers = await _on_every_ready_replica(gateway, "/v1/unload_lora_adapter", payload)
        gateway.pool.forget_adapter(body.lora_name)
        return {"status": "ok", "lora_name": body.lora_name, "replicas": len(answers)}


def _read(raw: bytes, model: type[Any]) -> Any:
    try:
        return validate_request(parse_json_object(raw), model)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


async def _on_every_ready_replica(
    gateway: Gateway, path: str, payload: dict[str, Any]
) -> list[httpx.Response]:
    """`payload` posted to `path` on every ready replica at once; 503 if none is ready or one
    cannot be reached."""
    replicas = [r.replica_id for r in gateway.pool.snapshot().replicas if r.ready]
    if not replicas:
        raise APIError(503, "no engine replica is ready; retry shortly", "service_unavailable")
    try:
        return list(
            await asyncio.gather(
                *(
                    gateway.client.post(
                        f"{gateway.pool.url_of(r)}{path}", json=payload, timeout=120
                    )
                    for r in replicas
                )
            )
        )
    except httpx.HTTPError as exc:
        raise APIError(503, f"an engine replica failed: {exc}", "service_unavailable") from exc


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
