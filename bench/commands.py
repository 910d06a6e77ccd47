"""`kvfleet bench ...`: argument parsing only here; each benchmark imports torch when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from kvfleet.engine.protocol.arguments import int_in


def _fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def add_commands(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (measure; see bench/README.md)")
    kinds = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    latency = kinds.add_parser(
        "latency", help="decode ms/token and TTFT at a batch size, beside the floor"
    )
    _add_latency_arguments(latency)
    latency.set_defaults(run=_run_latency)
    throughput = kinds.add_parser(
        "throughput", help="offline: N requests at once, tokens/s beside the workload's floor"
    )
    _add_throughput_arguments(throughput)
    throughput.set_defaults(run=_run_throughput)
    speculative = kinds.add_parser(
        "speculative", help="speculative decoding against none on a document-repeating task"
    )
    _add_speculative_arguments(speculative)
    speculative.set_defaults(run=_run_speculative)
    serve = kinds.add_parser(
        "serve", help="online client for an OpenAI server: TTFT, ITL, e2e percentiles"
    )
    _add_serve_arguments(serve)
    serve.set_defaults(run=_run_serve)
    structured = kinds.add_parser(
        "structured", help="decode step time under a JSON schema against none; compile times"
    )
    _add_structured_arguments(structured)
    structured.set_defaults(run=_run_structured)


def _add_prefill_graphs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=512,
        help="steps with prompt tokens up to this many replay CUDA graphs in pieces (0: eager)",
    )


def _add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help="a model, or a shipped config with --load-format dummy",
    )
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    _add_quantization_argument(parser)
    parser.add_argument("--batch-size", type=int_in(1), default=1)
    parser.add_argument("--input-len", type=int_in(1), default=128)
    parser.add_argument(
        "--output-len", type=int_in(2), default=128, help="(decode time: tokens after the first)"
    )
    parser.add_argument("--repeats", type=int_in(1), default=3)
    parser.add_argument(
        "--max-model-len",
        type=int_in(1),
        help="the engine's (default: input + output + 8; a server's longer one splits decode "
        "attention over more programs)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="TTFT of the prompt computed whole (with caching, each repeat of it is a prefix hit)",
    )
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int_in(1),
        default=1,
        help="GPUs the model is split across",
    )
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument(
        "--num-loras",
        type=int_in(0),
        default=0,
        help="random rank --lora-rank adapters to serve",
    )
    parser.add_argument("--lora-rank", type=int_in(1), default=16)
    parser.add_argument(
        "--lora-share",
        type=_fraction,
        default=1.0,
        help="fraction of the batch that names an adapter (round robin); 0: LoRA on, base only",
    )
    _add_prefill_graphs_argument(parser)
    parser.add_argument("--json", help="also write the result to this file")


def _add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization", default=None, help="the engine's --quantization (fp8); default: none"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's (auto, fp8)")


def _add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--load-format", default="auto", help="dummy: random prompts, weights")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int_in(1), default=1, help="1: one request at a time")
    parser.add_argument("--output-len", type=int_in(1), default=256)
    parser.add_argument("--max-model-len", type=int_in(1), default=2048)
    parser.add_argument("--repeats", type=int_in(1), default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4}',
        help="the engine's --speculative-config JSON",
    )
    parser.add_argument("--json", help="also write the result to this file")


def _run_speculative(args: argparse.Namespace) -> int:
    from kvfleet.bench import speculative

    return speculative.run(args)


def _run_latency(args: argparse.Namespace) -> int:
    from kvfleet.bench import latency

    return latency.run(args)


def _add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    _add_quantization_argument(parser)
    parser.add_argument("--num-prompts", type=int_in(1), default=256)
    parser.add_argument("--input-len", default="128:1024", help="N, or LOW:HIGH (uniform)")
    parser.add_argument("--output-len", default="256", help="N, or LOW:HIGH (uniform)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, help="default: longest input + output")
    parser.add_argument("--max-num-seqs", type=int_in(1), default=256)
    parser.add_argument("--max-num-batched-tokens", type=int_in(1), default=8192)
    parser.add_argument("--max-prefill-seqs", type=int_in(1), default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-blocks", type=int, help="fix the KV pool's size (blocks)")
    parser.add_argument("--swap-space-gib", type=float, default=4.0, help="0: recompute")
    parser.add_argument(
        "--unknown-end",
        action="store_true",
        help="requests stop at EOS too, so admission cannot see their end: the pool may "
        "fill and running requests be preempted (swap against recompute)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    _add_prefill_graphs_argument(parser)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int_in(1),
        default=1,
        help="GPUs the model is split across",
    )
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--json", help="also write the result to this file")


def _run_throughput(args: argparse.Namespace) -> int:
    from kvfleet.bench import throughput

    return throughput.run(args)


def _add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (HF)")
    parser.add_argument("--vocab-size", type=int, help="grow the tokenizer to this many tokens")
    parser.add_argument("--bounded", action="store_true", help="bounded strings and integers")
    parser.add_argument("--batch-size", type=int_in(1), default=64)
    parser.add_argument("--input-len", type=int_in(1), default=128)
    parser.add_argument("--output-len", type=int_in(2), default=128)
    parser.add_argument("--repeats", type=int_in(1), default=3)
    parser.add_argument("--json", help="also write the result to this file")


def _run_structured(args: argparse.Namespace) -> int:
    from kvfleet.bench import structured

    return structured.run(args)


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="the `model` to send (default: the server's first)")
    parser.add_argument(
        "--mode",
        choices=["random", "shared-prefix", "blocker"],
        default="random",
        help="random prompts; one long document with many questions; or N streams with one "
        "long prompt arriving among them",
    )
    parser.add_argument("--num-prompts", type=int_in(1), default=200)
    parser.add_argument("--input-len", default="1024", help="N, or LOW:HIGH (uniform)")
    parser.add_argument("--output-len", default="256", help="N, or LOW:HIGH (uniform)")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    parser.add_argument("--max-concurrency", type=int_in(1), help="at most this many in flight")
    parser.add_argument("--prefix-len", type=int, default=3000, help="shared-prefix: document")
    parser.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: documents (groups)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this"
    )
    parser.add_argument("--blocker-len", type=int, default=4096, help="blocker: its prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the result to this file")


def _run_serve(args: argparse.Namespace) -> int:
    from kvfleet.bench import serve

    return serve.run(args)
