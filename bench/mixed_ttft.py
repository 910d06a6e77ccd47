"""A prompt's time to first token when it arrives beside running decodes (the online row's
steps: a 1,024-token prompt joining a few requests mid-decode), in-process, each engine step
timed on the host, against the same prompt arriving alone.

    bench/device_env.sh python3 bench/mixed_ttft.py [--quantization fp8 --kv-cache-dtype fp8]
        [--profile]

Session 35 measured a lone 1,024-token prompt at 30.1 ms (bf16) and 18.2 ms (FP8 weights and
cache) to its first token, yet the FP8 online row's TTFT p50 no better than bf16's (42.4
against 40.0 ms): this shows which steps a joining prompt waits through, and how long each is.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvfleet.bench.timeline import profiled_wall
from kvfleet.bench.workload import random_workload
from kvfleet.engine.llm import LLM
from kvfleet.engine.protocol.arguments import int_in
from kvfleet.engine.sampling_params import SamplingParams

# The host range from adding the prompt to its first token (`--profile`)
JOIN = "join"


def joining_ttft(
    llm: LLM, decodes: int, context: int, input_len: int, round_: int
) -> tuple[float, list[float]]:
    """(ms from adding the prompt to its first token, ms of each step until then) with
    `decodes` requests of `context` prompt tokens decoding when it arrives."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    running = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    ids = [f"r{round_}-{i}" for i in range(decodes)]
    contexts = random_workload(decodes, (context, context), (1, 1), vocab, seed=round_).prompts
    for request_id, prompt in zip(ids, contexts, strict=True):
        engine.add_request(request_id, prompt, running)
    produced: dict[str, int] = {}
    while decodes and min(produced.get(i, 0) for i in ids) < 8:  # (all decoding, none queued)
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    prompt_id = f"p{round_}"
    (joining,) = random_workload(1, (input_len, input_len), (1, 1), vocab, seed=-1 - round_).prompts
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps: list[float] = []
    with torch.profiler.record_function(JOIN):
        began = time.perf_counter()
        engine.add_request(prompt_id, joining, first)
        while True:
            step_began = time.perf_counter()
            outputs = engine.step()
            steps.append((time.perf_counter() - step_began) * 1e3)
            if any(o.request_id == prompt_id and o.outputs[0].token_ids for o in outputs):
                break
        ttft = (time.perf_counter() - began) * 1e3
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return ttft, steps


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--input-len", type=int_in(1), default=1024)
    parser.add_argument(
        "--context", type=int_in(1), default=1024, help="each decoding request's prompt"
    )
    parser.add_argument("--decodes", type=int_in(0), nargs="+", default=[0, 4])
    parser.add_argument("--rounds", type=int_in(1), default=5)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then one round each under the torch profiler: host lead, GPU busy, gaps, tail",
    )
    return parser


def main() -> None:
    args = parser().parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=8192,
    )
    joining_ttft(llm, max(args.decodes), args.context, args.input_len, 1000)  # (warm-up)
    for decodes in args.decodes:
        runs = [
            joining_ttft(llm, decodes, args.context, args.input_len, r) for r in range(args.rounds)
        ]
        ttfts = [ttft for ttft, _ in runs]
        _, median_steps = sorted(runs)[len(runs) // 2]
        print(
            f"{args.quantization or 'bf16'} {args.input_len} tokens beside {decodes} decodes: "
            f"TTFT median {statistics.median(ttfts):.2f} ms (runs "
            f"{', '.join(f'{t:.1f}' for t in ttfts)}); steps of the median run: "
            f"{', '.join(f'{s:.1f}' for s in median_steps)} ms",
            flush=True,
        )
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        for decodes in args.decodes:
            with torch.profiler.profile(activities=activities) as prof:
                ttft, _ = joining_ttft(llm, decodes, args.context, args.input_len, 2000 + decodes)
            print(f"profiled, beside {decodes} decodes: TTFT {ttft:.2f} ms, "
                  f"{profiled_wall(prof, JOIN)}", flush=True)  # fmt: skip
    llm.engine.close()


if __name__ == "__main__":
    main()
