"""A replica killed with SIGKILL during 100 concurrent streams: every stream completes or ends
with a clean error event, none hangs, and new requests all reach the survivor, none failing
(a replica that cannot be reached is drained and the request retried elsewhere). Then 500
concurrent streams on two replicas: each completes or is refused with a body; nothing is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvfleet.bench.fake_engine import MODEL
from kvfleet.gateway.app import GatewaySettings, create_gateway_app

from .conftest import free_port
from .test_gateway_admission import serve

pytestmark = pytest.mark.timeout(300)
REPLICA_HEADER = "x-kvfleet-replica"


def start_fake_engine(chunks: int, chunk_delay: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.bench.fake_engine", "--port", str(port)]
    command += ["--chunks", str(chunks), "--chunk-delay", str(chunk_delay)]
    process = subprocess.Popen(command, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("the fake engine did not start")


@pytest.fixture
def two_engines() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    engines = [start_fake_engine(chunks=40, chunk_delay=0.05) for _ in range(2)]
    yield engines
    for process, _ in engines:
        if process.poll() is None:
            process.kill()
        process.wait(10)


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[str, str, str]:
    """(replica, outcome, last event): outcome is "done" or "error"."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return "", f"status {response.status_code}", await response.aread()  # type: ignore[return-value]
        replica = response.headers[REPLICA_HEADER]
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    errors = [e for e in events if '"error"' in e]
    assert events, "an empty stream"
    assert events[-1] == "data: [DONE]", events[-3:]
    return replica, "error" if errors else "done", events[-1]


def test_sigkill_during_100_streams(two_engines: list[tuple[subprocess.Popen[bytes], str]]) -> None:
    urls = tuple(url for _, url in two_engines)
    settings = GatewaySettings(replicas=urls, poll_interval_s=0.25)
    with serve(create_gateway_app(settings)) as gateway:

        async def run() -> tuple[list[tuple[str, str, str]], list[tuple[int, str | None]]]:
            async with httpx.AsyncClient(timeout=30) as client:
                streams = [asyncio.create_task(_stream(client, gateway)) for _ in range(100)]
                await asyncio.sleep(0.8)  # streams are mid-way (40 chunks x 50 ms)
                victim, _ = two_engines[0]
                victim.send_signal(signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*streams), 25)
                # New requests, sent at once: none may fail; all go to the survivor
                after = [
                    await client.post(
                        f"{gateway}/v1/completions", json={"model": MODEL, "prompt": "x"}
                    )
                    for _ in range(10)
                ]
                return results, [(r.status_code, r.headers.get(REPLICA_HEADER)) for r in after]

        results, after = asyncio.run(run())
    outcomes = [outcome for _, outcome, _ in results]
    assert set(outcomes) <= {"done", "error"}
    victim_url = two_engines[0][1]
    on_victim = [o for replica, o, _ in results if replica == victim_url]
    assert on_victim, "no stream was on the killed replica"
    assert set(on_victim) == {"error"}  # cut streams end with an error event
    assert all(o == "done" for replica, o, _ in results if replica != victim_url)
    survivor = two_engines[1][1]
    assert after == [(200, survivor)] * 10


def test_500_concurrent_streams_nothing_lost(
    two_engines: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    urls = tuple(url for _, url in two_engines)
    settings = GatewaySettings(replicas=urls, max_in_flight_per_replica=150, queue_capacity=100)
    with serve(create_gateway_app(settings)) as gateway:

        async def run() -> list[tuple[str, str, str]]:
            limits = httpx.Limits(max_connections=600)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                return await asyncio.gather(*(_stream(client, gateway) for _ in range(500)))

        results = asyncio.run(run())
    outcomes = [outcome for _, outcome, _ in results]
    assert len(outcomes) == 500
    assert outcomes.count("done") >= 400  # 300 slots + 100 queued
    refused = [last for _, outcome, last in results if outcome != "done"]
    assert all(outcome in ("done", "status 503") for outcome in outcomes)
    assert all(b"overloaded" in body for body in refused)  # type: ignore[operator]
