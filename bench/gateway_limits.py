"""Per-key limits across gateway pods: tokens a key gets through per minute, with one gateway and
with two peered gateways (`--peer`), its traffic spread over both or stuck to one.

    python -m kvfleet.bench.gateway_limits --tokens-per-min 6000 --minutes 2

Each gateway is a real `kvfleet gateway` process (API keys file, `--tokens-per-min`, `--peer`)
in front of one fake engine process; client threads send requests as fast as the gateways
answer (a 429 is retried after 10 ms). Every answered request is put in the minute it finished
in; the first minute holds the initial full bucket (a whole minute's budget) on top of the
refill, later minutes the refill alone. Prints tokens per minute and their ratio to the limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvfleet.bench.fake_engine import MODEL
from kvfleet.bench.gateway_overhead import _wait_ready
from kvfleet.bench.report import emit
from kvfleet.engine.worker.process import free_port
from kvfleet.gateway.admission.keys import hash_key

KEY = "bench-key"


@contextlib.contextmanager
def processes(tokens_per_min: float, gateways: int) -> Iterator[list[str]]:
    """A fake engine and `gateways` peered gateways; yields the gateways' URLs."""
    engine_port = free_port()
    ports = [free_port() for _ in range(gateways)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.json"
        keys.write_text(json.dumps({"keys": [{"id": "team", "sha256": hash_key(KEY)}]}))
        started = [
            subprocess.Popen(
                [sys.executable, "-m", "kvfleet.bench.fake_engine", "--port", str(engine_port)]
            )
        ]
        try:
            _wait_ready(f"http://127.0.0.1:{engine_port}")
            for port in ports:
                peers = [f"--peer={u}" for u in urls] if gateways > 1 else []
                command = [
                    sys.executable,
                    "-m",
                    "kvfleet.cli.main",
                    "gateway",
                    f"--replica=http://127.0.0.1:{engine_port}",
                    f"--port={port}",
                    "--host=127.0.0.1",
                    f"--api-keys={keys}",
                    f"--tokens-per-min={tokens_per_min}",
                    "--log-level=warning",
                    *peers,
                ]
                started.append(subprocess.Popen(command))
            for url in urls:
                _wait_ready(url)
            time.sleep(2.0)  # the peers have read each other
            yield urls
        finally:
            for process in started:
                process.terminate()
            for process in started:
                process.wait(30)


def hammer(
    urls: list[str], seconds: float, threads_per_url: int, key: str = KEY
) -> list[tuple[float, int]]:
    """(finish time from the start, tokens) of every answered request; any answer but 200 or
    429 (the limit) is an error."""
    answered: list[tuple[float, int]] = []
    lock = threading.Lock()
    began = time.monotonic()
    stop_at = began + seconds

    def worker(url: str) -> None:
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": MODEL, "prompt": list(range(8)), "max_tokens": 1}
        with httpx.Client(headers=headers, timeout=10) as client:
            while time.monotonic() < stop_at:
                response = client.post(f"{url}/v1/completions", json=body)
                if response.status_code == 200:
                    tokens = int(response.json()["usage"]["total_tokens"])
                    with lock:
                        answered.append((time.monotonic() - began, tokens))
                elif response.status_code == 429:
                    time.sleep(0.01)
                else:
                    raise RuntimeError(f"{url}: {response.status_code} {response.text}")

    workers = [
        threading.Thread(target=worker, args=(url,)) for url in urls for _ in range(threads_per_url)
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return answered


def per_minute(answered: list[tuple[float, int]], minutes: int) -> list[int]:
    totals = [0] * minutes
    for at, tokens in answered:
        if int(at // 60) < minutes:
            totals[int(at // 60)] += tokens
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-min", type=float, default=6000.0)
    parser.add_argument("--minutes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4, help="client threads per gateway")
    parser.add_argument("--output", help="also write the JSON result here")
    args = parser.parse_args()
    limit, minutes = args.tokens_per_min, args.minutes
    results = {}
    patterns = (("one gateway", 1, 1), ("two, spread", 2, 2), ("two, sticky", 2, 1))
    for name, gateways, used in patterns:
        with processes(limit, gateways) as urls:
            answered = hammer(urls[:used], minutes * 60.0, args.threads)
        totals = per_minute(answered, minutes)
        results[name] = totals
        ratios = ", ".join(f"{t / limit:.3f}" for t in totals)
        print(f"{name}: tokens per minute {totals} (x limit: {ratios})", flush=True)
    result = {"benchmark": "gateway_limits", "tokens_per_min": limit, "per_minute": results}
    emit(result, args.output)


if __name__ == "__main__":
    main()
