"""`kvfleet bench throughput`: offline, all requests submitted at once, beside the workload's floor.

    kvfleet bench throughput --model llama-3-8b --load-format dummy \\
        --num-prompts 256 --input-len 128:1024 --output-len 256

Prompts are random token ids (`workload.py`, seeded: the peer script runs the same ones); every
request generates exactly its output length (EOS ignored; with `--unknown-end` it may stop at EOS,
so admission cannot reserve its end and the pool may preempt), sampled at temperature 1.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvfleet.bench.ceilings import fp8_matmul_tflops, measure_ceilings, sync
from kvfleet.bench.report import emit
from kvfleet.bench.workload import parse_range, random_workload, workload_cost
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.worker.setup import freeze_startup_heap


def run(args: argparse.Namespace) -> int:
    input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len or input_len[1] + output_len[1],
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_seqs=args.max_prefill_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_blocks,
        swap_space_gib=args.swap_space_gib,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        prefill_graph_tokens=args.prefill_graph_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        async_scheduling=not args.no_async_scheduling,
    )
    freeze_startup_heap()  # (as a server would)
    engine = llm.engine
    config = engine.model_config
    workload = random_workload(
        args.num_prompts, input_len, output_len, config.vocab_size, seed=args.seed
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=not args.unknown_end, seed=None)
        for n in workload.output_lens
    ]
    # Warm-up (kernel compilation) on requests of the same shapes, outside the timing.
    warm = random_workload(4, input_len, output_len, config.vocab_size, seed=args.seed + 1)
    warm_tokens = min(8, output_len[0])
    llm.generate(
        warm.prompts, SamplingParams(temperature=1.0, max_tokens=warm_tokens, ignore_eos=True)
    )

    steps = _StepTimer(engine)
    sync(engine.device)
    began = time.perf_counter()
    with steps:
        outputs = llm.generate(workload.prompts, params)
    sync(engine.device)
    elapsed = time.perf_counter() - began

    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if not args.unknown_end:
        assert generated == workload.num_output_tokens, "a request stopped early"
    dtype_bytes = torch.empty((), dtype=engine.dtype).element_size()
    ceilings = measure_ceilings(engine.device, engine.dtype)
    weight_bytes, linear_flops_factor, fp8_tflops = None, 1.0, None
    if engine.quantization is not None:  # (what the quantized layers read and multiply at)
        model = engine.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if model.lm_head is not None:  # (the embedding table is looked up, not streamed)
            weight_bytes -= model.embed_tokens.weight.numel() * dtype_bytes
        fp8_tflops = fp8_matmul_tflops(engine.device)
        linear_flops_factor = ceilings.matmul_tflops / fp8_tflops
    kv_bytes = torch.empty((), dtype=engine.runner.kv_cache_dtype).element_size()
    cost = workload_cost(
        config,
        dtype_bytes,
        workload,
        args.max_num_seqs,
        weight_bytes,
        linear_flops_factor,
        kv_bytes,
    )
    # N GPUs stream and multiply their shares at once (the all-reduces are not in the floor)
    ranks = args.tensor_parallel_size
    floor_s = ceilings.floor_s(cost.bytes / ranks, cost.flops / ranks)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "model": args.model,
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "quantization": engine.quantization.describe() if engine.quantization else None,
        "kv_cache_dtype": str(engine.runner.kv_cache_dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_seqs": args.max_prefill_seqs,
        "prefix_caching": not args.no_prefix_caching,
        "unknown_end": args.unknown_end,
        "swap_space_gib": args.swap_space_gib,
        "input_tokens": workload.num_input_tokens,
        "output_tokens": generated,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 2),
        "output_tok_per_s": round(generated / elapsed, 1),
        "total_tok_per_s": round((generated + workload.num_input_tokens) / elapsed, 1),
        "copy_GBps": round(ceilings.copy_gbps, 1),
        "matmul_TFLOPs": round(ceilings.matmul_tflops, 1),
        "fp8_matmul_TFLOPs": round(fp8_tflops, 1) if fp8_tflops else None,
        "tensor_parallel_size": ranks,
        "floor_bytes_s": round(cost.bytes / ranks / (ceilings.copy_gbps * 1e9), 3),
        "floor_flops_s": round(cost.flops / ranks / (ceilings.matmul_tflops * 1e12), 3),
        "floor_s": round(floor_s, 3),
        "pct_of_floor": round(100 * floor_s / elapsed, 1),
        "steps": steps.summary(),
        "kv_blocks": engine.kv_cache_manager.block_pool.num_blocks,
        "preemptions": engine.scheduler.num_preemptions,
        "preemptions_swapped": engine.scheduler.num_swapped,
    }
    emit(result, args.json)
    engine.close()
    return 0


class _StepTimer:
    """Wall time of each engine step (its end waits on the sampled tokens), by kind of step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.times: dict[str, list[float]] = {"decode_only": [], "with_prefill": []}
        self.prefill_tokens = 0

    def __enter__(self) -> None:
        real_step = self.engine.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            outputs = real_step(*args, **kwargs)
            spent = time.perf_counter() - began
            out = self.engine.last_scheduler_output
            decode = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
            prefill = out.total_num_scheduled_tokens - decode
            self.prefill_tokens += prefill
            self.times["with_prefill" if prefill else "decode_only"].append(spent)
            return outputs

        self.engine.step = timed_step

    def __exit__(self, *exc: object) -> None:
        del self.engine.step  # back to the class's method

    def summary(self) -> dict[str, Any]:
        return {
            kind: {
                "count": len(t),
                "total_s": round(sum(t), 3),
                "mean_ms": round(1e3 * sum(t) / len(t), 2) if t else None,
            }
            for kind, t in self.times.items()
        } | {"prefill_tokens": self.prefill_tokens}
