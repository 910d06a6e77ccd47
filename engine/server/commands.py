"""`kvfleet engine`: argument parsing, then one engine's server (what a pod runs; `kvfleet serve`
puts the gateway in front of N of them, kvfleet/cli/serve.py). Imports stay light here: torch
and the server load only when the command runs."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

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
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--served-model-name", help="the name clients send as `model`")
    parser.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a tokenizer folder or hub id other than the model's")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks", type=int, help="KV-cache blocks (default: sized from memory)"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-prefill-seqs",
        type=int,
        default=32,
        help="at most this many requests compute prompt tokens in one step (bursts are "
        "served first come, a slice at a time)",
    )
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="run each step to its end before scheduling the next",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: triton on CUDA, torch elsewhere",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs for decode steps"
    )
    lora = parser.add_argument_group("multi-LoRA")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument("--max-loras", type=int, default=4, help="adapters in GPU slots at once")
    lora.add_argument(
        "--max-cpu-loras", type=int, help="adapters kept in host memory (default: --max-loras)"
    )
    lora.add_argument("--max-lora-rank", type=int, default=16)
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapter folders to load at start",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs (or, on the CPU, processes) one model is split across",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive": true}',
    )
    parser.add_argument("--max-body-bytes", type=int, default=8 << 20)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted",
    )
    parser.add_argument("--metrics-compat", choices=["vllm"], help="also expose vllm: metric names")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    # (`kvfleet serve` starts its engines so: the gateway in front says how to call it and
    # logs each request once)
    parser.add_argument("--behind-gateway", action="store_true", help=argparse.SUPPRESS)


def _settings(args: argparse.Namespace, model: str) -> Any:
    from kvfleet.engine.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from kvfleet.engine.protocol.openai import LoadLoRAAdapterRequest
    from kvfleet.engine.server.app import ServerSettings

    try:
        speculative = None
        if args.speculative_config:
            try:
                speculative = SpeculativeConfig.parse(args.speculative_config)
            except ValueError as exc:
                raise ValueError(f"--speculative-config: {exc}") from exc
        modules = LoadLoRAAdapterRequest.parse_flag(args.lora_modules, "--lora-modules")
        engine = EngineConfig(
            model=model,
            load_format=args.load_format,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            tokenizer=args.tokenizer,
            max_model_len=args.max_model_len,
            enable_kv_events=True,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            speculative=speculative,
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization,
                cpu_kv_cache_gib=args.cpu_kv_cache_gib,
                enable_prefix_caching=not args.no_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_prefill_seqs=args.max_prefill_seqs,
                enable_chunked_prefill=not args.no_chunked_prefill,
                async_scheduling=not args.no_async_scheduling,
            ),
            lora=LoRAConfig(
                enable_lora=args.enable_lora,
                max_loras=args.max_loras,
                max_cpu_loras=args.max_cpu_loras,
                max_lora_rank=args.max_lora_rank,
                lora_modules=tuple(modules),
            ),
        )
    except ValueError as exc:
        raise SystemExit(f"kvfleet: error: {exc}") from exc
    return ServerSettings(
        engine=engine,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        metrics_compat=args.metrics_compat,
        shutdown_timeout_s=args.shutdown_timeout,
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
