"""SIGTERM with a stream in flight: the stream ends, the engine loop stops, the process exits."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import MODEL, start_server

pytestmark = pytest.mark.timeout(300)


def test_sigterm_with_a_stream_in_flight(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--shutdown-timeout", "2")
    chunks: list[str] = []
    ended = threading.Event()

    def stream() -> None:
        body = {
            "model": MODEL,
            "prompt": "Count:",
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            with httpx.stream(
                "POST", f"{server.base_url}/completions", json=body, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line)
        except httpx.HTTPError:
            pass  # the server closing a stream it cancelled
        finally:
            ended.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    while len(chunks) < 3:
        time.sleep(0.05)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=60)
    assert ended.wait(30)
    log = server.log.read_text()
    assert code in (0, -signal.SIGTERM), log[-3000:]
    assert "Application shutdown complete" in log
    assert "engine loop stopped" in log
    assert time.monotonic() - started < 30  # bounded by --shutdown-timeout, not by the stream
    assert len(chunks) < 1500
