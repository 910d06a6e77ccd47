"""`kvfleet serve` is the product on one machine even with one engine: the gateway answers in
front of it (its metrics, its replica header), the announcement comes once the model answers,
and neither the model's loading nor the gateway's polls fill the log with /health lines."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from .conftest import MAX_MODEL_LEN, MODEL, Server, end_process, free_port, launch


def test_serve_puts_the_gateway_in_front_of_one_engine(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.cli.main", "serve", MODEL, "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "256"]

    def announced(server: Server) -> bool:
        return "kvfleet is serving" in server.log.read_text()

    server = launch(tmp_path, "serve", port, command, 300, announced)
    try:
        # (the announcement names the gateway's address, not the engine's)
        assert f"kvfleet is serving {MODEL} at {server.url}/v1" in server.log.read_text()
        for _ in range(3):  # polled meanwhile too: none of it may be logged
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        response = httpx.post(
            f"{server.base_url}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=120,
        )
        assert response.status_code == 200
        assert response.headers["x-kvfleet-replica"] == "http://127.0.0.1:8101"
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "kvfleet:gateway_requests_total{" in metrics
    finally:
        end_process(server)
    log = server.log.read_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log  # once, at the gateway
    assert log.count("POST /v1/chat/completions") == 1
    assert "GET /health" not in log  # neither the gateway's nor the engine's access log
    assert "HTTP Request: GET" not in log  # the gateway's polls of the engine
