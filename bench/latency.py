"""`kvfleet bench latency`: decode time per token and TTFT at a batch size, beside the floor.

Floor of one decode step: every weight is read once (the embedding table only for the batch's
rows) plus the batch's KV cache, over the copy bandwidth measured in the same run; FLOPs
(2 x parameters x batch) over the measured matmul rate, if larger. With `--num-loras`, random
adapters are served round robin over the batch and each distinct adapter's A and B join the
bytes of a step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvfleet.bench.ceilings import measure_ceilings, sync
from kvfleet.bench.lora_adapters import lora_engine_args
from kvfleet.bench.report import emit
from kvfleet.bench.workload import experts_read
from kvfleet.engine.layers.moe import SparseMoeBlock
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.worker.model_runner import kv_cache_bytes_per_block
from kvfleet.engine.worker.setup import freeze_startup_heap


def run(args: argparse.Namespace) -> int:
    if args.max_model_len is not None and args.max_model_len < args.input_len + args.output_len:
        print(
            f"--max-model-len {args.max_model_len} is shorter than --input-len + --output-len "
            f"({args.input_len + args.output_len})",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory(prefix="kvfleet-loras-") as scratch:
        return _run(args, Path(scratch))


def _read_per_step(
    model: Any, config: Any, param_bytes: int, batch_size: int
) -> tuple[float, float]:
    """(bytes a decode step streams, weights a token multiplies): every weight but the looked-up
    embedding table; of a mixture of experts, the experts the batch's tokens pick (expected
    under uniform routing; exact at batch 1) and the top k."""
    embedding = model.embed_tokens.weight
    streamed = float(param_bytes)
    if not config.tie_word_embeddings:
        streamed -= embedding.numel() * embedding.element_size()
    experts = sum(
        m.w13.numel() + m.w2.numel() for m in model.modules() if isinstance(m, SparseMoeBlock)
    )
    active = float(sum(p.numel() for p in model.parameters()))
    if experts:
        streamed -= (
            experts
            * (1 - experts_read(config, batch_size) / config.num_experts)
            * (embedding.element_size())
        )
        active -= experts * (1 - config.num_experts_per_tok / config.num_experts)
    return streamed, active


def _run(args: argparse.Namespace, scratch: Path) -> int:
    lora = lora_engine_args(args.model, args.load_format, scratch, args.num_loras, args.lora_rank)
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len or args.input_len + args.output_len + 8,
        max_num_seqs=max(args.batch_size, 1),
        max_num_batched_tokens=max(2048, args.batch_size * args.input_len),
        tensor_parallel_size=args.tensor_parallel_size,
        async_scheduling=not args.no_async_scheduling,
        prefill_graph_tokens=args.prefill_graph_tokens,
        **lora,
    )
    freeze_startup_heap()  # (as a server would)
    engine = llm.engine
    names = list(lora.get("lora_modules", {}))
    with_adapter = round(args.batch_size * args.lora_share) if names else 0
    adapters = [names[i % len(names)] if i < with_adapter else None for i in range(args.batch_size)]
    config = engine.model_config
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        100, config.vocab_size - 100, (args.batch_size, args.input_len), generator=generator
    ).tolist()

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        runs = []
        for _ in range(args.repeats):
            sync(engine.device)
            began = time.perf_counter()
            llm.generate(prompts, params, lora=adapters)
            sync(engine.device)
            runs.append(time.perf_counter() - began)
        return sorted(runs)[len(runs) // 2]

    warm_up = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, warm_up, lora=adapters)
    ttft_s = timed(1)
    total_s = timed(args.output_len)
    decode_s = (total_s - ttft_s) / (args.output_len - 1)

    # NOTE: with tensor parallelism these are rank 0's shard and KV heads: every rank streams
    # its own share at once, so one GPU's bytes over one GPU's bandwidth is the floor.
    model = engine.runner.model
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lora_bytes = 0
    if engine.lora is not None:
        per_slot = sum(
            (layer.lora_a[0].numel() + layer.lora_b[0].numel()) * layer.lora_a.element_size()
            for layer in engine.lora.layers
        )
        lora_bytes = per_slot * len({a for a in adapters if a is not None})
    streamed, active_params = _read_per_step(model, config, param_bytes, args.batch_size)
    context = args.input_len + args.output_len // 2
    local = engine.runner.config
    kv_bytes = (
        args.batch_size * context * kv_cache_bytes_per_block(local, 1, engine.runner.kv_cache_dtype)
    )
    ceilings = measure_ceilings(engine.device, engine.dtype)
    floor_s = ceilings.floor_s(
        streamed + kv_bytes + lora_bytes, 2 * active_params * args.batch_size
    )
    result: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "quantization": engine.quantization.describe() if engine.quantization else None,
        "kv_cache_dtype": str(engine.runner.kv_cache_dtype).removeprefix("torch."),
        "attention_backend": engine.attention_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "max_model_len": engine.max_model_len,
        "output_len": args.output_len,
        "copy_GBps": round(ceilings.copy_gbps, 1),
        "matmul_TFLOPs": round(ceilings.matmul_tflops, 1),
        "num_loras": args.num_loras,
        "requests_with_adapter": with_adapter,
        "lora_bytes_per_step": lora_bytes,
        "bytes_per_step": streamed + kv_bytes + lora_bytes,
        "floor_ms_per_token": round(floor_s * 1e3, 3),
        "decode_ms_per_token": round(decode_s * 1e3, 3),
        "pct_of_floor": round(100 * floor_s / decode_s, 1),
        "ttft_ms": round(ttft_s * 1e3, 2),
        "ttft_prefix_hit": not args.no_prefix_caching,
        "output_tok_per_s": round(args.batch_size / decode_s, 1),
    }
    emit(result, args.json)
    engine.close()
    return 0
