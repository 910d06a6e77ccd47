"""`kvfleet engine`: argument parsing, then one engine's server (what a pod runs; `kvfleet serve`
puts the gateway in front of N of them, kvfleet/cli/serve.py). Imports stay light here: torch
and the server load only when the command runs."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvfleet.engine.protocol.arguments import tcp_port

logger = logging.getLogger(__name__)

ENGINE_HOST, ENGINE_PORT = "0.0.0.0", 8100


def add_commands(commands: Any) -> None:
    engine = commands.add_parser(
        "engine",
        help="run one engine with its OpenAI API (what a pod runs)",
        description="Serve one model through kvfleet's engine with an OpenAI-compatible API.",
    )
    engine.add_argument(
        "--model", default="smollm2", help="alias, .gguf file, folder, hub id, or config"
    )
    add_server_arguments(engine, ENGINE_HOST, ENGINE_PORT)
    engine.set_defaults(run=_run_engine)


def add_server_arguments(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    """The engine's settings (one flag each, from the settings table, kvfleet/engine/config),
    then the server's."""
    from kvfleet.engine.config import engine_settings
    from kvfleet.engine.config.settings import add_arguments

    parser.add_argument("--host", default=host)
    parser.add_argument("--port", type=tcp_port, default=port)
    parser.add_argument("--served-model-name", help="the name clients send as `model`")
    add_arguments(parser, engine_settings())
    parser.add_argument("--max-body-bytes", type=int, default=8 << 20)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted",
    )
    parser.add_argument("--metrics-compat", choices=["vllm"], help="also expose vllm: metric names")
    parser.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json", "mistral"],
        default="auto",
        help="how the model writes tool calls (auto: from its chat template)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "deepseek_r1"],
        help="return <think>...</think> as reasoning_content",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    # (`kvfleet serve` starts its engines so: the gateway in front says how to call it and
    # logs each request once)
    parser.add_argument("--behind-gateway", action="store_true", help=argparse.SUPPRESS)


def _settings(args: argparse.Namespace, model: str) -> Any:
    from kvfleet.engine.config import EngineConfig, engine_settings
    from kvfleet.engine.config.settings import from_namespace
    from kvfleet.engine.server.app import ServerSettings

    given = from_namespace(engine_settings(), args)
    try:
        engine = EngineConfig.from_kwargs(
            model, {**given, "enable_kv_events": True}, flag_names=True
        )
    except ValueError as exc:
        raise SystemExit(f"kvfleet: error: {exc}") from exc
    return ServerSettings(
        engine=engine,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        metrics_compat=args.metrics_compat,
        shutdown_timeout_s=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        prestart_body_worker=True,
    )


def ready_message(name: str, url: str) -> str:
    """What a user sees once the model answers: where, and a first request to try."""
    return (
        f"\nkvfleet is serving {name} at {url}/v1\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{name}", "messages": [{{"role": "user", '
        '"content": "What is the capital of France?"}]}\'\n'
    )


def _run_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from kvfleet.engine.protocol.http import quiet_health_checks
    from kvfleet.engine.server.app import create_app
    from kvfleet.engine.worker.setup import freeze_startup_heap

    settings = _settings(args, args.model)
    url = f"http://{args.host}:{args.port}"

    def on_ready() -> None:
        freeze_startup_heap()  # (this process serves this one engine)
        if not args.behind_gateway:
            print(ready_message(settings.model_name, url), flush=True)

    def on_fatal() -> None:
        server.should_exit = True  # then `kvfleet engine` exits with code 1 (below)

    app = create_app(settings, on_ready=on_ready, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.behind_gateway,
        # NOTE: without this uvicorn waits forever for open streams on SIGTERM.
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
    )
    server = uvicorn.Server(config)
    quiet_health_checks()
    logger.info("starting on %s (the model loads in the background; /health says when ready)", url)
    server.run()
    state = app.state.kvfleet
    if state.fatal_error is not None:
        print(f"kvfleet: error: the engine failed: {state.fatal_error}", file=sys.stderr)
        return 1
    return 0 if state.load_error is None else 1
