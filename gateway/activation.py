"""Scale from zero: a request that finds no ready engine waits (bounded in number and time)
while the gateway raises the LLMDeployment's scale from 0 to 1 and the first engine starts.

Any gateway pod may activate: the write is "at least one replica", so two pods doing it at once
agree, and it never lowers a count (the elected autoscaler alone decides everything else).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvfleet.engine.protocol.http import APIError
from kvfleet.gateway.autoscaler import ScaleTarget

logger = logging.getLogger(__name__)


class Activator:
    def __init__(
        self,
        target: ScaleTarget,
        has_ready_replica: Callable[[], bool],
        capacity: int,
        timeout_s: float,
        poll_s: float = 0.1,
        rewrite_every_s: float = 10.0,
    ) -> None:
        self.target = target
        self.has_ready_replica = has_ready_replica
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.rewrite_every_s = rewrite_every_s  # checks the scale again at most this often
        self.waiting = 0
        self.activations = 0  # scale writes from 0 to 1
        self._checked_at = -float("inf")
        self._lock = asyncio.Lock()

    async def wait_for_replica(self) -> None:
        """Return once an engine is ready; 503 (with Retry-After) when too many requests wait
        already or none became ready within the activation timeout."""
        if self.waiting >= self.capacity:
            raise _unavailable(f"{self.waiting} requests already wait for an engine to start")
        self.waiting += 1
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self.has_ready_replica():
                await self._activate()
                if time.monotonic() >= deadline:
                    raise _unavailable(
                        f"no engine replica became ready within {self.timeout_s:g} s"
                    )
                await asyncio.sleep(self.poll_s)
        finally:
            self.waiting -= 1

    async def _activate(self) -> None:
        async with self._lock:  # one scale check at a time for all waiting requests
            now = time.monotonic()
            if now - self._checked_at < self.rewrite_every_s:
                return
            self._checked_at = now
            try:
                current = await asyncio.to_thread(self.target.get_replicas)
                if current == 0:
                    logger.info("scale from zero: a request waits; scaling to 1 replica")
                    await asyncio.to_thread(self.target.set_replicas, 1)
                    self.activations += 1
            except Exception as exc:  # the API server may be away: try again at the next check
                logger.warning("scale from zero failed: %s", exc)


def _unavailable(message: str) -> APIError:
    error = APIError(503, f"the service is starting: {message}", "service_unavailable")
    error.headers["Retry-After"] = "5"
    return error
