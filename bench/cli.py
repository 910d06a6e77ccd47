"""`kvfleet bench ...`: argument parsing only here; each benchmark imports torch when it runs."""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (measure; see bench/README.md)")
    kinds = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    latency = kinds.add_parser(
        "latency", help="decode ms/token and TTFT at a batch size, beside the floor"
    )
    _add_latency_arguments(latency)
    latency.set_defaults(run=_run_latency)


def _add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help="a model, or a shipped config with --load-format dummy",
    )
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", help="also write the result to this file")


def _run_latency(args: argparse.Namespace) -> int:
    from kvfleet.bench import latency

    return latency.run(args)
