"""Discovery: ready endpoints from EndpointSlices; the replica pool following a changing set."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvfleet.gateway.discovery import ready_endpoints
from kvfleet.gateway.replicas import ReplicaPool
from kvfleet.gateway.routing.prefix_index import PrefixIndex
from kvfleet.gateway.routing.snapshot import ReplicaId

SLICES = [
    {
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8100}],
        "endpoints": [
            {"addresses": ["10.0.0.5"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.6"], "conditions": {"ready": False}},  # not ready
            {"addresses": ["10.0.0.7"], "conditions": {"ready": True, "terminating": True}},
            {"addresses": ["10.0.0.8"]},  # no conditions: ready, as the API says
        ],
    },
    {"ports": [{"name": "http", "port": 8100}], "endpoints": [{"addresses": ["fd00::9"]}]},
    {"ports": [{"name": "other", "port": 1}], "endpoints": [{"addresses": ["10.0.0.10"]}]},
    {"ports": None, "endpoints": None},
]


def test_ready_endpoints_on_the_named_port() -> None:
    assert ready_endpoints(SLICES, "http") == [
        "http://10.0.0.5:8100",
        "http://10.0.0.8:8100",
        "http://[fd00::9]:8100",
    ]
    assert "http://10.0.0.10:1" in ready_endpoints(SLICES, None)  # first port of each slice


@pytest.mark.asyncio
async def test_pool_follows_added_and_removed_replicas() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(503))
    async with httpx.AsyncClient(transport=transport) as client:
        index = PrefixIndex()
        pool = ReplicaPool(["http://a:1"], client, index, poll_interval_s=0.01)
        pool.start()
        index.load_snapshot(ReplicaId("http://a:1"), [], seq=0)
        await pool.set_replicas(["http://b:1/", "http://c:1"])
        assert sorted(pool.replicas) == ["http://b:1", "http://c:1"]
        assert not index.is_live(ReplicaId("http://a:1"))  # its index is gone
        await asyncio.sleep(0.05)
        assert all(not r.ready for r in pool.snapshot().replicas)  # 503 health: not ready
        await pool.stop()


@pytest.mark.asyncio
async def test_a_request_counted_running_leaves_the_load_when_it_ends() -> None:
    # The replica's reading shows the gateway's one request running; when that request ends,
    # the replica is idle again at once, not at its next reading (which would send the next
    # new document elsewhere for no reason).
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="kvfleet:num_requests_running 1\n")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": []})
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        pool = ReplicaPool(["http://a:1"], client, PrefixIndex())
        replica = pool.replicas[ReplicaId("http://a:1")]
        pool.add_in_flight(replica.replica_id, 1)
        await pool._poll(replica)  # the reading counts the request as running
        assert replica.state.load == 1
        pool.add_in_flight(replica.replica_id, -1)  # it ends
        assert replica.state.load == 0
        pool.add_in_flight(replica.replica_id, -1)  # (one more than counted: never below 0)
        assert replica.state.load == 0
