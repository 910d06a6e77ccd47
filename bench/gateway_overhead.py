"""Gateway overhead: the same requests straight to a fast fake engine and through the gateway.

    python -m kvfleet.bench.gateway_overhead --requests 2000

The fake engine answers a completion at once (no model) and serves SmolLM2's tokenizer, so the
difference between the two latency distributions is what the gateway adds: parsing,
admission, tokenizing and hashing the prompt, routing, and one proxied HTTP hop on loopback.
Each server runs in its own process. Prints p50/p90/p99 of both and of the
difference at each percentile.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import httpx
import uvicorn

from kvfleet.bench.fake_engine import MODEL, fake_engine
from kvfleet.bench.report import emit
from kvfleet.engine.worker.process import free_port
from kvfleet.gateway.app import GatewaySettings, create_gateway_app


def _run_engine(port: int) -> None:
    from kvfleet.engine.loader.source import resolve_model_source
    from kvfleet.engine.tokenizer import Tokenizer

    info = Tokenizer.load(resolve_model_source("smollm2")).info(MODEL, 16).model_dump()
    uvicorn.run(fake_engine(info), host="127.0.0.1", port=port, log_level="warning")


def _run_gateway(port: int, engine_url: str) -> None:
    app = create_gateway_app(GatewaySettings(replicas=(engine_url,)))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def timed(client: httpx.Client, url: str, count: int) -> list[float]:
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox jumps over the lazy dog",
        "max_tokens": 1,
    }
    times = []
    for _ in range(count):
        began = time.perf_counter()
        response = client.post(f"{url}/v1/completions", json=body)
        times.append(time.perf_counter() - began)
        assert response.status_code == 200, response.text
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    # NOTE: each server in its own process, as deployed: in one process they would share the
    # interpreter lock with each other and with this client.
    spawn = multiprocessing.get_context("spawn")
    engine_port, gateway_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    processes = [
        spawn.Process(target=_run_engine, args=(engine_port,), daemon=True),
        spawn.Process(target=_run_gateway, args=(gateway_port, engine_url), daemon=True),
    ]
    for process in processes:
        process.start()
    try:
        _wait_ready(engine_url)
        _wait_ready(gateway_url)
        with httpx.Client(timeout=30) as client:
            timed(client, engine_url, 200)  # warm-up, both paths
            timed(client, gateway_url, 200)
            direct, through = [], []
            for _ in range(4):  # interleaved rounds, so drift hits both alike
                direct += timed(client, engine_url, args.requests // 4)
                through += timed(client, gateway_url, args.requests // 4)
    finally:
        for process in processes:
            process.terminate()

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[int(q) - 1] * 1e3

    result: dict[str, Any] = {"requests": len(direct)}
    for q in (50, 90, 99):
        result[f"direct_p{q}_ms"] = round(pct(direct, q), 3)
        result[f"gateway_p{q}_ms"] = round(pct(through, q), 3)
        result[f"overhead_p{q}_ms"] = round(pct(through, q) - pct(direct, q), 3)
    emit(result, args.json)


if __name__ == "__main__":
    main()
