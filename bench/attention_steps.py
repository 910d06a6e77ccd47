"""Attention of one layer at Llama-3-8B's head shapes on the GPU: the decode kernel's tiles swept
over a bf16 and an FP8 cache, a mixed step (decodes beside prompt chunks) before and after
its decode rows went to the decode kernel, and the prompt kernel's tiles on prompts (TFLOP/s
of the causal pairs it must compute, beside the bf16 matmul ceiling).

    bench/device_env.sh python3 bench/attention_steps.py --part tiles [--cache fp8] [--splits 1 2]
    bench/device_env.sh python3 bench/attention_steps.py --part mixed
    bench/device_env.sh python3 bench/attention_steps.py --part prompt
    bench/device_env.sh python3 bench/attention_steps.py --part prompt-splits [--splits 1 2 4]

To set another tree beside this one in the same call, run the script again with that tree's
package first on PYTHONPATH (its kernels import each other: one file of it cannot be loaded
beside this tree's). The inputs are seeded: both runs time the same steps.

Every figure is a median over repeats in microseconds per layer, of device time (calls
captured in a CUDA graph, so the host's launch gaps stay out) unless it says eager. The decode
floor is the KV bytes a step reads (each sequence's K and V once) at the copy bandwidth
measured in the same run; the caches (over a GB a layer) are far larger than L2, and their
blocks are shuffled across the pool as a serving engine's are.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.attention import triton_attention, triton_decode, triton_prompt
from kvfleet.engine.attention.metadata import AttentionMetadata, leading_decodes
from kvfleet.engine.protocol.arguments import int_in

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
# (BLOCK_N, warps, stages, register cap) tried for each cache.
TILES: dict[bool, list[tuple[int, int, int, int | None]]] = {
    False: [
        (64, 4, 3, None),
        (64, 4, 5, None),
        (32, 4, 6, None),
        (128, 8, 4, None),
        (64, 4, 2, None),
        (32, 4, 3, None),
        (32, 4, 2, None),
    ],
    True: [
        (128, 4, 3, 128),
        (128, 4, 3, None),
        (128, 4, 3, 144),
        (128, 4, 4, 128),
        (128, 4, 3, 104),
        (64, 4, 3, None),
        (256, 8, 3, None),
    ],
}
# Decode steps swept: (sequences, shortest, longest), lengths drawn between and sorted longest
# first as the runner orders them: the 1,000 x 1,024 -> 1,024 run's steps, the 256-request
# offline run's, a few long sequences (split over the length), and `bench latency
# --batch-size 64`'s (128 in, 128 out: short, where the kernel is at ~46% of its floor).
DECODE_STEPS = ((256, 1025, 2047), (256, 200, 1280), (64, 3000, 5000), (64, 129, 256))
# The prompt kernel's tiles tried on long steps: (BLOCK_M, BLOCK_N, warps, stages).
PROMPT_TILES = [
    (64, 32, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
]
# Prompt steps: (query lengths, KV lengths)
PROMPT_STEPS = {
    "one 8,192 prompt": ([8192], [8192]),
    "a 2,048 chunk after 6,144 cached": ([2048], [8192]),
    "4 x 1,024 prompts": ([1024] * 4, [1024] * 4),
    "7.9k prompt tokens of the 1k/1k run": ([1024] * 7 + [774], [1024] * 7 + [774]),
    "a prefix hit: 32 new tokens after 3,000 cached": ([32], [3032]),
}


def make_step(
    query_lens: list[int], seq_lens: list[int], fp8: bool, seed: int = 0, kv_heads: int = KV_HEADS
) -> dict[str, Any]:
    """q, a KV cache holding every sequence (blocks shuffled across the pool) and the step's
    metadata, ordered as the runner orders a step (its decodes counted first)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(counts) + 1
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    taken, slots = 0, []
    for row, (q_len, n, count) in enumerate(zip(query_lens, seq_lens, counts, strict=True)):
        tables[row, :count] = order[taken : taken + count]
        taken += count
        slots += [int(tables[row, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n - q_len, n)]
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"),
        block_tables=tables.cuda(),
        cu_seqlens_q=cu.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        num_decodes=leading_decodes(query_lens),
    )
    shape = (2, num_blocks, BLOCK, kv_heads, HEAD_DIM)
    cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cache = cache.to(FP8) if fp8 else cache
    return {"q": q, "cache": cache, "metadata": metadata, "scales": torch.ones(2, device="cuda")}


def graph_us(fn: Callable[[], object], replays: int = 8) -> float:
    """Device time of `fn` in microseconds, without the host's launch gaps: `replays` calls
    captured in one CUDA graph, the graph's median replay time divided among them."""
    replay = captured(lambda: [fn() for _ in range(replays)])
    return median_seconds(replay, torch.device("cuda"), repeats=10) / replays * 1e6


def kv_bytes(seq_lens: list[int], fp8: bool, kv_heads: int = KV_HEADS) -> int:
    return sum(seq_lens) * 2 * kv_heads * HEAD_DIM * (1 if fp8 else 2)


@contextmanager
def compiled_kernels(found: list[Any]) -> Iterator[None]:
    """Collect the compiled partial kernels launched inside (their registers and spills; each
    variant once)."""
    launcher = triton_decode._DECODE_PARTIAL
    real = launcher.kernel

    class Spy:
        params = real.params

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def launch(*args: Any, **kwargs: Any) -> Any:
                compiled = real[grid](*args, **kwargs)
                found.append(compiled)
                return compiled

            return launch

    launcher.kernel, launcher.runners = Spy(), {}  # (every variant launched through the spy)
    try:
        yield
    finally:
        launcher.kernel = real


def sweep_tiles(
    copy_gbps: float,
    caches: tuple[bool, ...] = (False, True),
    splits: tuple[int, ...] = (),
    steps: tuple[tuple[int, int, int], ...] = DECODE_STEPS,
    kv_heads: int = KV_HEADS,
    min_splits: tuple[int, ...] = (),
) -> None:
    """The decode kernel's TILES over `steps`, for each cache (fp8 or not) in `caches`, at the
    splits `num_splits_for` plans and at each of `splits`; with `min_splits`, at each of these
    least tokens a split (`triton_decode._MIN_SPLIT_TOKENS`) too, the plan's splits made anew."""
    shipped = dict(triton_decode.DECODE_TILES)
    shipped_min = triton_decode._MIN_SPLIT_TOKENS
    gen = torch.Generator().manual_seed(2)
    for num_seqs, shortest, longest in steps:
        drawn = torch.randint(shortest, longest + 1, (num_seqs,), generator=gen)
        lens = sorted(drawn.tolist(), reverse=True)
        name = f"{num_seqs} x [{shortest}, {longest}]"
        for fp8 in caches:
            step = make_step([1] * num_seqs, lens, fp8, kv_heads=kv_heads)
            floor_us = kv_bytes(step["metadata"].seq_lens_cpu, fp8, kv_heads) / (copy_gbps * 1e3)
            out = torch.empty_like(step["q"])
            run = functools.partial(
                triton_decode.decode_attention, step["q"], step["cache"], step["metadata"],
                0.088, out=out, kv_scales=step["scales"],
            )  # fmt: skip
            run()
            expected = out.float().clone()  # (the shipped tile's, at the planned splits)
            variants = itertools.product(TILES[fp8], (None, *splits), (shipped_min, *min_splits))
            for tile, num_splits, min_split in variants:
                triton_decode.DECODE_TILES[fp8] = tile
                triton_decode._MIN_SPLIT_TOKENS = min_split
                plan = triton_decode.num_splits_for(num_seqs, kv_heads, lens[0], out.device)
                timed = functools.partial(run, num_splits=num_splits)
                found: list[Any] = []
                try:
                    with compiled_kernels(found):
                        timed()
                    error = (out.float() - expected).abs().max().item()
                    us = graph_us(timed)
                except Exception as exc:  # (a tile that does not fit: say so, go on)
                    print(f"{name} fp8={fp8} {tile}: failed: {exc!r}"[:300])
                    continue
                k = found[-1]
                print(
                    f"{name} {'fp8 ' if fp8 else 'bf16'} tile {tile} "
                    f"splits {num_splits or f'{plan} (plan)'} of >= {min_split} tokens: "
                    f"{us:7.1f} us ({floor_us / us:5.1%} of floor {floor_us:.1f} us) "
                    f"regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} "
                    f"max |diff| vs shipped {error:.2e}"
                )
            triton_decode.DECODE_TILES.update(shipped)
            triton_decode._MIN_SPLIT_TOKENS = shipped_min


def time_mixed(step: dict[str, Any], fp8: bool) -> dict[str, float]:
    """us per layer of a mixed step's attention: all rows in the varlen kernel, the decodes
    split off to the decode kernel, and the decode kernel alone over those rows."""
    split = step["metadata"]
    joined = dataclasses.replace(split, num_decodes=0)
    scales = step["scales"] if fp8 else None
    backend = triton_attention.TritonAttention(HEADS, KV_HEADS, HEAD_DIM)
    q, cache = step["q"], step["cache"]
    figures = {
        "all rows in the varlen kernel": lambda: backend.attend(q, cache, joined, scales),
        "decodes split off": lambda: backend.attend(q, cache, split, scales),
        "(the decode kernel alone)": lambda: triton_decode.decode_attention(
            q[: split.num_decodes], cache, split, backend.scale, kv_scales=scales
        ),
    }
    device = torch.device("cuda")
    times = {label: graph_us(fn) for label, fn in figures.items()}
    # (eager, as the engine runs a mixed step: the host's launches between the kernels)
    eager = {
        f"{label}, eager": median_seconds(fn, device, 20) * 1e6 for label, fn in figures.items()
    }
    return times | eager


def mixed_steps(copy_gbps: float) -> None:
    """About 250 decodes at 1-2k tokens beside ~7.9k prompt tokens (a step of the 1,000 x
    1,024 -> 1,024 run), and a step of eight decodes beside one 1,024-token prompt (online)."""
    gen = torch.Generator().manual_seed(1)
    steps = {
        "250 decodes + 7.9k prompt tokens": (250, [1024] * 7 + [774]),
        "8 decodes + one 1,024 prompt": (8, [1024]),
    }
    for name, (decodes, prompts) in steps.items():
        lens = sorted(torch.randint(1025, 2048, (decodes,), generator=gen).tolist(), reverse=True)
        for fp8 in (False, True):
            step = make_step([1] * decodes + prompts, lens + prompts, fp8)
            floor_us = kv_bytes(lens, fp8) / (copy_gbps * 1e3)
            for label, us in time_mixed(step, fp8).items():
                print(
                    f"{name}, {'fp8' if fp8 else 'bf16'} cache: {label}: {us:8.1f} us "
                    f"(decode KV floor {floor_us:.1f} us)"
                )


def causal_flops(query_lens: list[int], seq_lens: list[int]) -> float:
    """Q.K and P.V over the (query, key) pairs a causal step attends: 4 x head_dim each."""
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(query_lens, seq_lens, strict=True))
    return 4.0 * HEAD_DIM * HEADS * pairs


def prompt_tiles(matmul_tflops: float) -> None:
    """Each prompt step with the shipped tiles and each tile of the prompt kernel (for the
    step's kind): us per layer, TFLOP/s, and the largest difference from the shipped tiles'
    output."""
    kernels: dict[str, Callable[..., torch.Tensor]] = {"shipped": triton_prompt.paged_attention}
    for tile in PROMPT_TILES:
        kernels[str(tile)] = functools.partial(_with_tile, tile)
    for name, (query_lens, seq_lens) in PROMPT_STEPS.items():
        flops = causal_flops(query_lens, seq_lens)
        for fp8 in (False, True):
            step = make_step(query_lens, seq_lens, fp8)
            scales = step["scales"] if fp8 else None
            kind = triton_prompt.prompt_step_kind(step["metadata"])
            expected = triton_prompt.paged_attention(
                step["q"], step["cache"], step["metadata"], 0.088, kv_scales=scales
            )
            for label, kernel in kernels.items():

                def run(
                    kernel: Callable[..., torch.Tensor] = kernel,
                    step: dict[str, Any] = step,
                    scales: torch.Tensor | None = scales,
                ) -> torch.Tensor:
                    q, cache, metadata = step["q"], step["cache"], step["metadata"]
                    return kernel(q, cache, metadata, 0.088, kv_scales=scales)

                try:
                    differs = (run().float() - expected.float()).abs().max().item()
                    us = graph_us(run)
                except Exception as exc:  # (a tile that does not fit: say so, go on)
                    print(f"{name} fp8={fp8} {label}: failed: {exc!r}"[:300])
                    continue
                tflops = flops / us / 1e6
                print(
                    f"{name} ({kind}), {'fp8' if fp8 else 'bf16'} cache, {label}: {us:8.1f} us, "
                    f"{tflops:6.1f} TFLOP/s ({tflops / matmul_tflops:5.1%} of the matmul "
                    f"ceiling), max |diff| from shipped {differs:.2e}"
                )


# Prompt steps whose keys the plan may split: (query lengths, KV lengths)
SPLIT_STEPS = {"one 512 prompt": ([512], [512]), "one 1,024 prompt": ([1024], [1024]),
               "one 2,048 prompt": ([2048], [2048]), "2 x 1,024 prompts": ([1024] * 2, [1024] * 2),
               "32 new tokens after 3,000 cached": ([32], [3032]),
               "a 512 chunk after 2,048 cached": ([512], [2560])}  # fmt: skip


def prompt_splits(splits: tuple[int, ...], matmul_tflops: float) -> None:
    """The prompt kernel at the plan's splits of the keys and at `splits`: us, TFLOP/s."""
    for name, (query_lens, seq_lens) in SPLIT_STEPS.items():
        flops = causal_flops(query_lens, seq_lens)
        for fp8 in (False, True):
            step = make_step(query_lens, seq_lens, fp8)
            scales = step["scales"] if fp8 else None
            call = functools.partial(triton_prompt.paged_attention, step["q"], step["cache"],
                                     step["metadata"], 0.088, kv_scales=scales)  # fmt: skip
            expected = call()
            for count in (None, *splits):

                def run(call: Callable[[], torch.Tensor] = call, count: int | None = count) -> Any:
                    with triton_prompt.splits_forced(count) if count else nullcontext():
                        return call()

                differs = (run().float() - expected.float()).abs().max().item()
                us = graph_us(run)
                cache = f"{'fp8' if fp8 else 'bf16'} cache, splits {count or 'plan'}"
                print(f"{name}, {cache}: {us:8.1f} us, {flops / us / 1e6:6.1f} TFLOP/s (of "
                      f"{matmul_tflops:.0f}), max |diff| {differs:.1e}")  # fmt: skip


def _with_tile(tile: tuple[int, int, int, int], *args: Any, **kwargs: Any) -> torch.Tensor:
    """The prompt kernel with `tile` for steps of every kind but "short"."""
    shipped = dict(triton_prompt.PROMPT_TILES)
    for key in shipped:
        if key[1] != "short":
            triton_prompt.PROMPT_TILES[key] = tile
    try:
        return triton_prompt.paged_attention(*args, **kwargs)
    finally:
        triton_prompt.PROMPT_TILES.update(shipped)


def _step(text: str) -> tuple[int, int, int]:
    """SEQS:SHORTEST:LONGEST as a decode step of `sweep_tiles` (argparse reports a bad one)."""
    seqs, shortest, longest = (int(value) for value in text.split(":"))
    if not (seqs > 0 and 0 < shortest <= longest):
        raise ValueError(text)
    return seqs, shortest, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--part", choices=("tiles", "mixed", "prompt", "prompt-splits"), required=True
    )
    parser.add_argument("--cache", choices=("both", "bf16", "fp8"), default="both",
                        help="--part tiles: the caches swept")  # fmt: skip
    parser.add_argument("--splits", type=int_in(1), nargs="*", default=[],
                        help="--part tiles, prompt-splits: splits of the KV tried beside the "
                             "plan's")  # fmt: skip
    parser.add_argument("--min-split", type=int_in(1), nargs="*", default=[],
                        help="--part tiles: least tokens a split, tried beside 128")  # fmt: skip
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS,
                        help="--part tiles: KV heads (query heads: 32)")  # fmt: skip
    parser.add_argument("--steps", nargs="*", default=[], type=_step,
                        help="--part tiles: decode steps SEQS:SHORTEST:LONGEST (default: "
                             "Llama-3-8B's serving steps)")  # fmt: skip
    args = parser.parse_args()
    ceilings = measure_ceilings(torch.device("cuda"), torch.bfloat16)
    print(
        f"{torch.cuda.get_device_name()}: copy {ceilings.copy_gbps:.0f} GB/s, "
        f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s"
    )
    if args.part == "tiles":
        caches = {"both": (False, True), "bf16": (False,), "fp8": (True,)}[args.cache]
        steps = tuple(args.steps)
        sweep_tiles(
            ceilings.copy_gbps, caches, tuple(args.splits), steps or DECODE_STEPS, args.kv_heads,
            tuple(args.min_split),
        )  # fmt: skip
    elif args.part == "mixed":
        mixed_steps(ceilings.copy_gbps)
    elif args.part == "prompt-splits":
        prompt_splits(tuple(args.splits), ceilings.matmul_tflops)
    else:
        prompt_tiles(ceilings.matmul_tflops)


if __name__ == "__main__":
    main()
