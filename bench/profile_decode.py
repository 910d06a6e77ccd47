"""Where a decode step's time goes: host phases, the graph replay's GPU time, torch profiler.

    bench/device_env.sh python3 bench/profile_decode.py --batch-size 1     # on the device

Prints the step time (steps overlapped as the engine runs them); each host phase of a step run
one at a time (schedule, the runner up to its device-to-host copy, scheduler update and output
processing); the GPU time of one graph replay and of the LM head + sampler (one GPU only); then
the top operators by host and by GPU time on rank 0 (`--trace`: its Chrome trace too).
`--prompt-len 600` puts the contexts near those of the 256-request throughput workload;
`--quantization` and `--kv-cache-dtype` as the engine takes them; `--num-loras N --lora-rank R`:
N random adapters (`bench/lora_adapters.py`) over the batch round robin, the graph replayed the
one with LoRA. `--ttft`: instead, a prompt step of `--batch-size` prompts whose blocks are
cached but the last (as `bench latency` times its TTFT), timed and profiled.
"""

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvfleet.bench.ceilings import median_seconds
from kvfleet.bench.lora_adapters import lora_engine_args
from kvfleet.engine.llm import LLM
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.protocol.arguments import int_in
from kvfleet.engine.sampling_params import SamplingParams


def _gpu_ms(fn: Callable[[], object]) -> float:
    return median_seconds(fn, torch.device("cuda"), repeats=20) * 1e3


def _prompts(
    batch_size: int, prompt_len: int, loras: list[str]
) -> list[tuple[list[int], str | None]]:
    """`batch_size` prompts of `prompt_len` tokens, each with its adapter (`loras` round robin,
    None without)."""
    return [
        (list(range(1000 + i, 1000 + i + prompt_len)), loras[i % len(loras)] if loras else None)
        for i in range(batch_size)
    ]


def _start_decoding(
    engine: LLMEngine, prompts: list[tuple[list[int], str | None]], params: SamplingParams
) -> None:
    """The requests of `prompts`, stepped until every prompt is in, so the steps timed after
    are decode steps."""
    for i, (prompt, lora) in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params, lora_name=lora)
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()


def _ttft(llm: LLM, batch: list[tuple[list[int], str | None]]) -> None:
    """`bench latency`'s TTFT: its prompts' first token, all but their last block cached."""
    prompts = [prompt for prompt, _ in batch]
    adapters = [lora for _, lora in batch]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, params, lora=adapters)  # (the blocks cached)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        began = time.perf_counter()
        llm.generate(prompts, params, lora=adapters)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    print(f"TTFT {len(batch)} x {len(prompts[0])}: {statistics.median(times) * 1e3:.1f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, lora=adapters)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key, limit in (("self_cpu_time_total", 20), ("self_cuda_time_total", 15)):
        print(averages.table(sort_by=key, row_limit=limit, max_name_column_width=60))


def _torch_profile(engine: LLMEngine, trace: str | None) -> None:
    """Ten steps under the torch profiler: the top operators by host and by GPU time, and
    rank 0's Chrome trace to `trace`."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    averages = prof.key_averages()
    for key, limit in (("self_cpu_time_total", 25), ("self_cuda_time_total", 15)):
        print(averages.table(sort_by=key, row_limit=limit, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--quantization", help="fp8, rtn (INT4), ...; default none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--profile", action="store_true", help="also the torch profiler tables")
    parser.add_argument("--trace", help="also profile, and write rank 0's Chrome trace here")
    parser.add_argument("--num-loras", type=int_in(0), default=0)
    parser.add_argument("--ttft", action="store_true", help="profile a cached prompt step")
    parser.add_argument("--lora-rank", type=int_in(1), default=16)
    parser.add_argument(
        "--cprofile", action="store_true", help="also Python's profiler over 20 engine steps"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        _profile(args, Path(scratch))


def _profile(args: argparse.Namespace, scratch: Path) -> None:
    lora = lora_engine_args(args.model, "dummy", scratch, args.num_loras, args.lora_rank)
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.prompt_len + 900,
        max_num_seqs=max(args.batch_size, 8),
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **lora,
    )
    engine = llm.engine
    prompts = _prompts(args.batch_size, args.prompt_len, list(lora.get("lora_modules", {})))
    if args.ttft:
        _ttft(llm, prompts)
        return
    params = SamplingParams(temperature=args.temperature, max_tokens=800, ignore_eos=True)
    _start_decoding(engine, prompts, params)
    began = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    print(f"batch {args.batch_size}: {(time.perf_counter() - began) / 50 * 1e3:.3f} ms/step")

    phases: dict[str, list[float]] = {"schedule": [], "runner": [], "update+output": []}
    for _ in range(50):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        runner_out = engine.runner.execute_model(out)
        t2 = time.perf_counter()
        core = engine.scheduler.update_from_output(out, runner_out)
        engine.output_processor.process(core, time.monotonic())
        t3 = time.perf_counter()
        phases["schedule"].append(t1 - t0)
        phases["runner"].append(t2 - t1)
        phases["update+output"].append(t3 - t2)
    for name, values in phases.items():
        print(f"  host {name:14s} {statistics.median(values) * 1e3:.3f} ms")

    runner = engine.runner
    graphs = runner.decode_graphs
    if graphs is not None and args.tensor_parallel_size == 1:  # (a lone replay would wait)
        bucket = min(b for b in graphs.buckets if b >= args.batch_size)
        graph, hidden = graphs.graphs[bucket, 1, bool(args.num_loras)]
        print(f"  GPU graph replay (bucket {bucket}) {_gpu_ms(graph.replay):.3f} ms")
        rows = hidden[: args.batch_size]
        print(
            "  GPU LM head + argmax "
            f"{_gpu_ms(lambda: runner.model.compute_logits(rows).argmax(-1)):.3f} ms"
        )
    if args.cprofile:
        stats = cProfile.Profile()
        stats.runcall(lambda: [engine.step() for _ in range(20)])
        for key in ("tottime", "cumulative"):
            pstats.Stats(stats).sort_stats(key).print_stats(30)
    if args.profile or args.trace:
        _torch_profile(engine, args.trace)
    engine.close()


if __name__ == "__main__":
    main()
