"""Stop a non-streaming request's work when its client goes away.

A stream stops by itself (sending to a closed connection fails and its generator is closed); a
request answered in one piece would run to its end for nobody, holding KV blocks and a batch
slot. Light on purpose (no engine imports): the gateway uses it too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
CLIENT_CLOSED = 499  # the status logged for a request whose client left (nginx's)


class ClientGone(Exception):
    """The client disconnected before the answer was ready; its work was cancelled."""


async def unless_disconnected(request: Request, work: Awaitable[T], every_s: float = 0.2) -> T:
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
