"""Request bodies: 413 with the OpenAI error body over a limit (BodyLimitMiddleware), and the
CPU work on a body (parsing, validation, templating, tokenizing) kept off the event loop
(`off_loop`), so no single body stalls other streams.

Light on purpose (no engine imports): the gateway uses it too.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvfleet.engine.protocol import error_body

_T = TypeVar("_T")

# From this size a body's work runs with the cyclic garbage collector paused: building
# objects for a 4 MB body (100,000 messages) sets off full collections that hold the GIL
# ~0.1 s each, stalling every thread. Reference counting frees the body's objects anyway.
LARGE_BODY_BYTES = 1 << 20
# A pause is not extended past this: under a stream of large bodies the collector still runs.
_MAX_GC_PAUSE_S = 10.0
_large_bodies = threading.BoundedSemaphore(2)  # large bodies worked on at once


async def off_loop(size: int, work: Callable[..., _T], *args: Any) -> _T:
    """`work(*args)` in a worker thread; `size`: the body's bytes (a large one waits for one
    of two slots and runs with the garbage collector paused)."""
    if size < LARGE_BODY_BYTES:
        return await asyncio.to_thread(work, *args)
    return await asyncio.to_thread(_GC_PAUSE.run, work, *args)


class _GCPause:
    """Automatic garbage collection off while any large body is worked on (process-wide:
    the counter makes overlapping pauses one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._since = 0.0

    def run(self, work: Callable[..., _T], *args: Any) -> _T:
        with _large_bodies:
            return self._run(work, *args)

    def _run(self, work: Callable[..., _T], *args: Any) -> _T:
        with self._lock:
            held = self._holders > 0 or gc.isenabled()
            if self._holders and time.monotonic() - self._since > _MAX_GC_PAUSE_S:
                held = False  # paused long enough: this one runs with the collector on
            if held:
                if self._holders == 0:
                    self._since = time.monotonic()
                    gc.disable()
                self._holders += 1
        try:
            return work(*args)
        finally:
            if held:
                with self._lock:
                    self._holders -= 1
                    if self._holders == 0:
                        gc.enable()
                        if time.monotonic() - self._since > _MAX_GC_PAUSE_S:
                            gc.collect()  # (before another pause can begin)


_GC_PAUSE = _GCPause()


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
