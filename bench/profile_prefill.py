"""Where a prompt step's time goes: steps of only prompt tokens (the 1,000 x 1,024 run's
prefill, 8 prompts of 1,024 tokens a step by default), timed on the host around a synchronized
step, beside the FLOP floor at the bf16 (or FP8) matmul peak measured in the same run, then
one step under the torch profiler (the top operators by GPU time).

    bench/device_env.sh python3 bench/profile_prefill.py [--quantization fp8 --kv-cache-dtype fp8]

Every request is fresh (no prefix hit) and asks one token, so a step holds prompts only.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvfleet.bench.ceilings import fp8_matmul_tflops, measure_ceilings
from kvfleet.engine.llm import LLM
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams

_ids = itertools.count()


def _prompt_step(engine: LLMEngine, prompts: int, prompt_len: int) -> float:
    """Seconds of one step of `prompts` fresh prompts (each its own token ids)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(prompts):
        n = next(_ids)
        start = 1000 + (n * 7919) % 100_000  # (distinct first tokens: no prefix hits)
        engine.add_request(f"p{n}", [(start + i) % 120_000 for i in range(prompt_len)], params)
    torch.cuda.synchronize()
    began = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--quantization", help="fp8, rtn (INT4), ...; default none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    tokens = args.prompts * args.prompt_len
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.prompt_len + 16,
        max_num_seqs=max(args.prompts, 8),
        max_num_batched_tokens=tokens,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.engine
    device = torch.device("cuda")
    peak = (
        fp8_matmul_tflops(device)
        if args.quantization == "fp8"
        else measure_ceilings(device, torch.bfloat16).matmul_tflops
    )
    config = engine.runner.model.config
    linear = sum(p.numel() for n, p in engine.runner.model.named_parameters() if "layers" in n)
    flops = 2 * tokens * linear  # (+ attention's, below)
    attention = 2 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    flops += attention * args.prompts * args.prompt_len * (args.prompt_len + 1) / 2
    for _ in range(2):  # (compiles, graphs)
        _prompt_step(engine, args.prompts, args.prompt_len)
    times = [_prompt_step(engine, args.prompts, args.prompt_len) for _ in range(5)]
    step = statistics.median(times)
    print(
        f"{args.prompts} x {args.prompt_len} prompt tokens a step: {step * 1e3:.1f} ms "
        f"(runs {', '.join(f'{t * 1e3:.1f}' for t in times)}); {flops / 1e12:.1f} TFLOP at "
        f"{peak:.0f} TFLOP/s: floor {flops / peak / 1e9:.1f} ms ({flops / peak / 1e12 / step:.0%})"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _prompt_step(engine, args.prompts, args.prompt_len)
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60
        )
    )
    engine.close()


if __name__ == "__main__":
    main()
