"""Per-key rate limits held by the whole gateway, not per pod: each pod reads what its peers
charged each key (`GET /internal/usage`, every `interval_s`) and charges the differences to its
own buckets (`RateLimiter.charge_peer`).

Why peers exchanging usage rather than splitting each limit by the number of pods: clients keep
connections open, so one client's requests stay on one pod; a pod holding 1/N of the limit
would refuse that client at 1/N of what it paid for. Exchanged usage keeps every pod's view of
a key within one sync interval of the truth, whichever pods the requests reach, with no store
to run. Between two exchanges each pod takes at most 1/N of what it last saw left (N pods), so
pods admitting at once never spend the same budget twice; a pod that gets all of a key's
traffic takes half of what is left each interval with two pods, the whole rate in steady state.

A peer is known by the instance id it reports: its own URL in the list is skipped, and a peer
that restarted (new instance, counters from zero) is read afresh rather than refunded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfleet.gateway.admission.rate_limit import KeyId, RateLimiter, Usage

logger = logging.getLogger(__name__)

USAGE_PATH = "/internal/usage"


def usage_body(instance: str, limiter: RateLimiter) -> dict[str, Any]:
    """What `GET /internal/usage` answers."""
    usage = limiter.usage()
    return {"instance": instance, "usage": {k: [u.requests, u.tokens] for k, u in usage.items()}}


@dataclass
class PeerSync:
    limiter: RateLimiter
    client: httpx.AsyncClient
    peer_urls: Callable[[], list[str]]  # every gateway pod's URL, this one's may be among them
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    # peer URL -> (its instance, what it had charged when last read)
    _seen: dict[str, tuple[str, dict[KeyId, Usage]]] = field(default_factory=dict)

    def count(self) -> int:
        """Gateway pods sharing the limits: this one and the peers that answered."""
        return 1 + len(self._seen)

    async def sync_once(self) -> None:
        urls = set(self.peer_urls())
        for url in list(self._seen):
            if url not in urls:
                del self._seen[url]  # gone: its charges stay charged
        results = await asyncio.gather(*(self._read(u) for u in urls), return_exceptions=True)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException) or result is None:
                continue
            instance, usage = result
            if instance == self.instance:
                continue  # this pod itself
            before = self._seen.get(url)
            self._seen[url] = (instance, usage)
            if before is None or before[0] != instance:
                continue  # first reading (or a restart): a baseline, nothing to charge
            now = self.clock()
            for key_id, now_used in usage.items():
                was = before[1].get(key_id, Usage())
                requests, tokens = now_used.requests - was.requests, now_used.tokens - was.tokens
                if requests or tokens:
                    self.limiter.charge_peer(key_id, requests, tokens, now)
        self.limiter.synced(self.clock())

    async def _read(self, url: str) -> tuple[str, dict[KeyId, Usage]] | None:
        try:
            response = await self.client.get(f"{url.rstrip('/')}{USAGE_PATH}", timeout=1.0)
            body = response.json()
            usage = {
                KeyId(str(k)): Usage(float(v[0]), float(v[1])) for k, v in body["usage"].items()
            }
            return str(body["instance"]), usage
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
            logger.debug("peer %s: usage not read: %s", url, exc)
            return None

    async def run(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self.interval_s)
