"""The HTTP side of the wire contract, shared by the engine's server and the gateway: the OpenAI
error body (`APIError`, its handler), the request-body limit (413), and cancelling a
non-streaming request's work when its client leaves.

Light on purpose (no engine imports): the gateway uses it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

_T = TypeVar("_T")
CLIENT_CLOSED = 499  # the status logged for a request whose client left (nginx's)


class _NoHealthChecks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and args[2] == "/health")


def quiet_health_checks() -> None:
    """Leave `/health` polls (kubelet probes, the gateway's health checks, a user waiting for
    the model to load) out of uvicorn's access log; every other request stays in it."""
    logging.getLogger("uvicorn.access").addFilter(_NoHealthChecks())


class APIError(Exception):
    """An error answered with the OpenAI error body (engine and gateway alike)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers: dict[str, str] = {}  # e.g. Retry-After

    def __reduce__(self) -> tuple[Any, ...]:
        """(Pickled whole: a request read in a worker process raises it across.)"""
        return (type(self), (self.status, self.message, self.type, self.code), self.__dict__)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type_, param=param, code=code)
    ).model_dump()


async def api_error_response(_: Any, exc: Exception) -> Any:
    """The exception handler of both servers: an APIError as the OpenAI error body, with its
    status and headers (e.g. Retry-After)."""
    from fastapi.responses import JSONResponse

    assert isinstance(exc, APIError)  # (registered for APIError only)
    body = error_body(exc.message, exc.type, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


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


class ClientGone(Exception):
    """The client disconnected before the answer was ready; its work was cancelled."""


async def unless_disconnected(request: Request, work: Awaitable[_T], every_s: float = 0.2) -> _T:
    """`work`'s result; ClientGone (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone("the client disconnected")
    finally:
        if not task.done():
            task.cancel()  # its engine requests abort as their streams close
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
