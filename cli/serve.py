"""`kvfleet serve`: the product on one machine. N engine processes on loopback (ports 8101..,
or from --first-engine-port), the gateway in this process in front of them on --port (default
8000), as in a cluster: the same queuing, rate limits, prefix-aware routing,
`kvfleet:gateway_*` metrics and `x-kvfleet-replica` header, with one replica as with many."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from kvfleet.engine.protocol.arguments import MAX_PORT, int_in, tcp_port
from kvfleet.engine.server import commands as engine_commands

SERVE_HOST, SERVE_PORT = "127.0.0.1", 8000
_READY_POLL_S = 0.5


def add_command(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the local stack (gateway and engines) on http://127.0.0.1:8000",
        description="Run kvfleet on this machine: engines behind the gateway, as in a cluster.",
    )
    serve.add_argument(
        "model", nargs="?", default="smollm2", help="what to serve (default smollm2)"
    )
    engine_commands.add_server_arguments(serve, SERVE_HOST, SERVE_PORT)
    serve.add_argument(
        "--replicas",
        type=int_in(1),
        default=1,
        help="engines behind the gateway (ports from --first-engine-port; default 1)",
    )
    serve.add_argument(
        "--first-engine-port",
        type=tcp_port,
        default=engine_commands.ENGINE_PORT + 1,
        help="the first engine's port on loopback, the next ones after it (default 8101)",
    )
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """N engine processes on loopback, the gateway in this one in front of them."""
    import uvicorn

    from kvfleet.engine.protocol.http import quiet_health_checks
    from kvfleet.engine.protocol.openai import LoadLoRAAdapterRequest
    from kvfleet.gateway.app import GatewaySettings, create_gateway_app

    forwarded = _forwarded_engine_arguments(args)
    ports = [args.first_engine_port + i for i in range(args.replicas)]
    if ports[-1] > MAX_PORT:
        raise ValueError(
            f"--first-engine-port {args.first_engine_port} leaves no port for engine "
            f"{args.replicas} of --replicas {args.replicas} (ports end at {MAX_PORT})"
        )
    replicas = tuple(f"http://127.0.0.1:{port}" for port in ports)
    url = f"http://{args.host}:{args.port}"
    engines: list[subprocess.Popen[bytes]] = []
    # NOTE: a SIGTERM before uvicorn takes the signal over must still stop the engines.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        for port in ports:
            command = [sys.executable, "-m", "kvfleet.cli.main", "engine", "--model", args.model]
            command += ["--host", "127.0.0.1", "--port", str(port), "--behind-gateway", *forwarded]
            engines.append(subprocess.Popen(command))
        name = args.served_model_name or args.model
        count = f"{len(engines)} engine{'s' if len(engines) > 1 else ''}"
        print(f"kvfleet: {count} of {name} starting behind the gateway on {url}", flush=True)
        threading.Thread(target=_announce_when_ready, args=(url, name), daemon=True).start()
        # (the adapters the engines load at start, reloaded by the gateway on one that restarts)
        adapters = tuple(LoadLoRAAdapterRequest.parse_flag(args.lora_modules, "--lora-modules"))
        settings = GatewaySettings(replicas=replicas, adapters=adapters, prestart_body_worker=True)
        app = create_gateway_app(settings)
        quiet_health_checks()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per health poll)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            try:
                engine.wait(timeout=args.shutdown_timeout + 20)
            except subprocess.TimeoutExpired:
                engine.kill()
    return 0


def _announce_when_ready(url: str, name: str) -> None:
    """Say how to call the stack once the gateway answers /health (an engine has loaded the
    model and the gateway has seen it ready)."""
    import httpx

    host, port = url.removeprefix("http://").rsplit(":", 1)
    local = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    while True:
        try:
            if httpx.get(f"http://{local}:{port}/health", timeout=2).status_code == 200:
                print(engine_commands.ready_message(name, url), flush=True)
                return
        except httpx.TransportError:
            pass
        time.sleep(_READY_POLL_S)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _forwarded_engine_arguments(args: argparse.Namespace) -> list[str]:
    """The engine options given to `serve`, for each replica's `kvfleet engine`: its settings
    (from the settings table), then the server's."""
    from kvfleet.engine.config import engine_settings
    from kvfleet.engine.config.settings import flags_for, from_namespace

    settings = engine_settings()
    forwarded = flags_for(settings, from_namespace(settings, args))
    for name in _SERVER_OPTIONS:
        value = getattr(args, name)
        if value is not None:
            forwarded.append(f"--{name.replace('_', '-')}={value}")
    return forwarded


_SERVER_OPTIONS = (
    "served_model_name",
    "max_body_bytes",
    "shutdown_timeout",
    "metrics_compat",
    "log_level",
    "tool_call_parser",
    "reasoning_parser",
)
