"""Where a prefix-cache hit's time goes, one request at a time (no queueing, no server).

    bench/device_env.sh python3 bench/prefix_probe.py [--prefix-len 3000] [--new-len 32]

Llama-3-8B shape, dummy weights. A shared prefix is primed once; then, alternately, requests
of the prefix plus `--new-len` fresh tokens (hits) and of wholly fresh prompts of the same
length (misses), one output token each: the wall time of each `generate` (its TTFT), the
engine steps it took and their wall times, then a cProfile of a few hits (host time by
function) and one hit under the torch profiler: its kernels, and its wall time split into the
host's lead, GPU busy time, GPU gaps and tail (`bench/timeline.py`; `--trace FILE` writes the
Chrome trace), to tell host from device.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfleet.bench.timeline import profiled_wall
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams


def _timed(real: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """`real`, appending the wall time (seconds) of each call to `into`."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - began)

    return timed


def timed_steps(engine: Any) -> list[float]:
    """Wall time of every engine step from now on (appended as they run)."""
    times: list[float] = []
    engine.step = _timed(engine.step, times)
    return times


def report_phases(llm: LLM, hit: Callable[[], Any], hits: int = 10) -> None:
    """Host wall time (no profiler) of `hits` hits' steps by phase: the scheduler, the
    runner's launch (inputs, copies, the forward's launches), its input copies alone, the
    prefill pieces' replay with their eager attention, and taking a step's outputs (which
    waits for the GPU)."""
    from kvfleet.engine.worker import inputs

    engine, runner = llm.engine, llm.engine.runner
    places = [
        ("schedule", engine.scheduler, "schedule"),
        ("launch", runner, "launch"),
        ("to_device (inputs)", inputs, "to_device"),
        ("pieces", runner.prefill_graphs, "run"),
        ("finish", engine, "_finish_step"),
    ]
    places = [(name, owner, attr) for name, owner, attr in places if owner is not None]
    totals: dict[str, list[float]] = {name: [] for name, _, _ in places}
    reals = [(owner, attr, getattr(owner, attr)) for _, owner, attr in places]
    for (name, owner, attr), (_, _, real) in zip(places, reals, strict=True):
        setattr(owner, attr, _timed(real, totals[name]))
    try:
        for _ in range(hits):
            hit()
    finally:
        for owner, attr, real in reals:
            setattr(owner, attr, real)
    print(f"host phases of {hits} hits, no profiler (ms a hit; the longest call):")
    for name, calls in totals.items():
        mean, longest = 1e3 * sum(calls) / hits, 1e3 * max(calls, default=0)
        print(f"  {name:22s} {mean:7.3f}   longest {longest:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--prefix-len", type=int, default=3000)
    parser.add_argument("--new-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--trace", help="write the profiled hit's Chrome trace here")
    parser.add_argument(
        "--prefill-graph-tokens", type=int, default=512, help="0: steps with prompt tokens eager"
    )
    args = parser.parse_args()
    for name in ("prefix_len", "new_len", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefix_len + args.new_len > 8192:
        parser.error("--prefix-len + --new-len must fit the 8,192-token context")
    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=8192,
        enforce_eager=args.enforce_eager,
        prefill_graph_tokens=args.prefill_graph_tokens,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    total = args.prefix_len + args.new_len

    def fresh(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

    prefix = fresh(args.prefix_len)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prefix + fresh(args.new_len)], one)  # primes the prefix (and compiles)
    llm.generate([fresh(total)], one)
    steps = timed_steps(llm.engine)
    results: dict[str, list[tuple[float, list[float]]]] = {"hit": [], "miss": []}
    for _ in range(args.repeats):
        for kind in ("hit", "miss"):
            prompt = prefix + fresh(args.new_len) if kind == "hit" else fresh(total)
            steps.clear()
            began = time.perf_counter()
            llm.generate([prompt], one)
            results[kind].append((time.perf_counter() - began, list(steps)))
    for kind, runs in results.items():
        walls = [1e3 * w for w, _ in runs]
        step_ms = [[round(1e3 * s, 2) for s in st] for _, st in runs[:3]]
        print(
            f"{kind}: TTFT median {statistics.median(walls):.2f} ms (min {min(walls):.2f}); "
            f"steps of the first three: {step_ms}"
        )
    hit, miss = (statistics.median(w for w, _ in results[k]) for k in ("hit", "miss"))
    print(f"miss / hit: {miss / hit:.2f}x")

    report_phases(llm, lambda: llm.generate([prefix + fresh(args.new_len)], one))

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        llm.generate([prefix + fresh(args.new_len)], one)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("hit"):
            llm.generate([prefix + fresh(args.new_len)], one)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(f"one hit, host and GPU (bench/timeline.py): {profiled_wall(prof, 'hit')}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    llm.engine.close()


if __name__ == "__main__":
    main()
