"""Per-key limits held by several gateway pods (`gateway.peers`), simulated on one clock: every
pod reads its peers' `/internal/usage` (served by httpx's MockTransport from the peers' own
limiters) each second, and what a key gets through per minute is what one gateway would give."""

from __future__ import annotations

import asyncio

import httpx

from kvfleet.gateway.admission.rate_limit import KeyId, KeyLimits, RateLimiter, Reservation
from kvfleet.gateway.peers import PeerSync, usage_body

KEY = KeyId("team")
LIMIT = 6000.0  # tokens a minute
COST = 9  # tokens a request


def admitted_per_minute(pods: int, hammered: int, minutes: int = 2) -> list[int]:
    """`pods` gateways, the key's client trying 100 requests a second on each of the first
    `hammered`; tokens admitted in each minute."""
    now = [0.0]
    urls = [f"http://gateway-{i}" for i in range(pods)]
    syncs: list[PeerSync] = []
    limiters = [RateLimiter({}, KeyLimits(tokens_per_min=LIMIT)) for _ in range(pods)]

    def answer(request: httpx.Request) -> httpx.Response:
        index = urls.index(f"http://{request.url.host}")
        return httpx.Response(200, json=usage_body(syncs[index].instance, limiters[index]))

    async def run() -> list[int]:
        totals = [0] * minutes
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for limiter in limiters:
                sync = PeerSync(limiter, client, lambda: urls, clock=lambda: now[0])
                syncs.append(sync)
                limiter.peers = sync.count
            for sync in syncs:
                await sync.sync_once()  # the peers have read each other once
            for step in range(minutes * 60 * 100):
                now[0] = step / 100
                for limiter in limiters[:hammered]:
                    if isinstance(limiter.reserve(KEY, COST, now[0]), Reservation):
                        totals[int(now[0] // 60)] += COST
                if step % 100 == 99:
                    for sync in syncs:
                        await sync.sync_once()
        return totals

    return asyncio.run(run())


def test_two_pods_admit_what_one_pod_admits_spread_or_sticky() -> None:
    (alone_first, alone_then) = admitted_per_minute(1, 1)
    # the first minute holds a full bucket besides the refill; then the refill alone
    assert abs(alone_first - 2 * LIMIT) <= 0.02 * LIMIT
    assert abs(alone_then - LIMIT) <= 0.02 * LIMIT
    for hammered in (2, 1):  # traffic on both pods, or all on one (sticky connections)
        first, then = admitted_per_minute(2, hammered)
        assert abs(then - LIMIT) <= 0.1 * LIMIT, (hammered, then)
        assert abs(first - alone_first) <= 0.1 * alone_first, (hammered, first)


def test_without_peers_each_pod_would_admit_the_whole_limit() -> None:
    """The mechanism under test: the same two pods, never syncing, admit twice the limit."""
    limiters = [RateLimiter({}, KeyLimits(tokens_per_min=LIMIT)) for _ in range(2)]
    admitted = 0
    for step in range(60 * 100, 120 * 100):  # the second minute, past the initial buckets
        for limiter in limiters:
            if isinstance(limiter.reserve(KEY, COST, step / 100), Reservation):
                admitted += COST
    assert admitted > 1.8 * LIMIT
