"""A real engine server for integration tests: `kvfleet engine` serving SmolLM2 on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvfleet.engine.worker.process import free_port

MODEL = "smollm2"
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics without a histogram bucket, by its full name with labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "_bucket{" not in line:
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples


def launch(
    tmp_path: Path,
    name: str,
    port: int,
    command: list[str],
    timeout_s: float,
    is_ready: Callable[[Server], bool],
) -> Server:
    """Start `command` (its output in a log), wait until `is_ready`; the log's tail on failure."""
    log = tmp_path / f"{name}-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the {name} exited with {process.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            if is_ready(server):
                return server
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(
        f"the {name} was not ready within {timeout_s:g} s:\n{log.read_text()[-3000:]}"
    )


def engine_options(port: int) -> list[str]:
    """Where a test engine listens, and the small float32 SmolLM2 engine every test runs."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-blocks",
        "1024",
    ]


def start_server(tmp_path: Path, *extra: str) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.cli.main", "engine", "--model", MODEL]
    command += [*engine_options(port), *extra]
    return launch(
        tmp_path,
        "engine",
        port,
        command,
        180,
        lambda server: httpx.get(f"{server.url}/health", timeout=2).status_code == 200,
    )


def end_process(server: Server, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s` (no check of how)."""
    server.process.terminate()
    try:
        server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.process.kill()


def stop_server(server: Server) -> None:
    """SIGTERM, and check the shutdown was graceful. NOTE: uvicorn re-raises the signal once it
    has shut down cleanly, so the exit status is -SIGTERM, not 0."""
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise
    log = server.log.read_text()
    assert code in (0, -signal.SIGTERM), log[-3000:]
    assert "Application shutdown complete" in log
    assert "engine loop stopped" in log


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("engine"))
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`kvfleet serve` (the gateway in front of one engine) reading Hermes tool calls and
    Qwen3-style reasoning: the structured-output and tool-call tests share it."""
    port = free_port()
    command = [sys.executable, "-m", "kvfleet.cli.main", "serve", MODEL, "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "2048"]
    command += [
        "--first-engine-port",
        str(free_port()),
        "--max-num-seqs",
        "64",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    ]
    server = launch(
        tmp_path_factory.mktemp("serve"),
        "serve",
        port,
        command,
        300,
        lambda s: "kvfleet is serving" in s.log.read_text(),
    )
    yield server
    end_process(server)
