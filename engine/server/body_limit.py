"""BodyLimitMiddleware: 413 with the OpenAI error body for a request body over a limit.

Light on purpose (no engine imports): the gateway uses it too.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from kvfleet.engine.protocol import error_body


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, by Content-Length or as it streams in."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        received = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        body = json.dumps(
            error_body(
                f"the request body is larger than {self.max_bytes} bytes",
                "invalid_request_error",
                "request_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
