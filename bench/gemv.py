"""Batch-1 matmuls (GEMV) in bf16 at the weight shapes of decode steps (Llama-3-70B over two GPUs,
Llama-3-8B, Qwen3-30B-A3B's attention and router): cuBLAS through F.linear against torch.mv
(cuBLAS's matrix-vector path) and the Triton GEMV (engine/layers/triton_gemv.py, launched
dependent where the GPU can: consecutive calls overlap as consecutive layers do), in CUDA
graphs of 20 calls over distinct weights (no cache reuse), beside the copy bandwidth. The LM
heads (128k-152k words) stay with cuBLAS in the engine (`linear.TRITON_GEMV_MAX_BYTES`); they
are timed here to say whether they should not.

    bench/device_env.sh python3 bench/gemv.py [--shapes 8b-lm-head ...]

With `--rows 2 8 16 32 64`: products of that many rows instead, cuBLAS (F.linear) against the
tensor-core GEMV over rows (`triton_gemv.rows_mma`, its plan and the tilings in ROWS_TILINGS),
for `linear.MMA_GEMV_ROWS`.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfleet.bench.ceilings import measure_ceilings, median_seconds
from kvfleet.engine.layers.triton_gemv import gemv, mma_plan, rows_mma

# name: (out_features, in_features) per rank
SHAPES = {
    "70b-tp2-qkv": (5120, 8192),
    "70b-tp2-o": (8192, 4096),
    "70b-tp2-gate_up": (28672, 8192),
    "70b-tp2-down": (8192, 14336),
    "8b-tp1-qkv": (6144, 4096),
    "8b-tp1-o": (4096, 4096),
    "8b-tp1-gate_up": (28672, 4096),
    "8b-tp1-down": (4096, 14336),
    "30b-a3b-qkv": (5120, 2048),
    "30b-a3b-o": (2048, 4096),
    "30b-a3b-router": (128, 2048),
    "8b-lm-head": (128256, 4096),
    "30b-a3b-lm-head": (151936, 2048),
}
COPIES = 20
# `rows_mma` (BLOCK_N, BLOCK_K, warps) and split (None: its plan's) beside its plan
ROWS_TILINGS: list[tuple[tuple[int, int, int], int | None]] = [
    ((64, 64, 4), None),
    ((64, 128, 4), None),
    ((64, 256, 4), None),
    ((64, 128, 4), 8),
]


def replay_us(
    fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], device: torch.device
) -> float:
    """us a call of fn over COPIES weights in one CUDA graph (median replay)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return median_seconds(graph.replay, device, repeats=20) * 1e6 / len(weights)


def _rows_mma_tiled(
    x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int], split: int | None
) -> torch.Tensor:
    return rows_mma(x, w, None, tiles, split)


def rows_table(shapes: list[str], row_counts: list[int], copy_gbps: float) -> None:
    device = torch.device("cuda")
    for name in shapes:
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(COPIES)]
        floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
        for m in row_counts:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = F.linear(x.float(), weights[0].float())
            row = [f"{name:16s} rows {m:3d} floor {floor_us:7.1f} us"]
            methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
                "cublas": lambda w: F.linear(x, w)  # noqa: B023
            }
            plan = mma_plan(n, k, device, rows=m, element_bytes=2)
            methods[f"mma plan {plan[1]}/split {plan[3]}"] = lambda w: rows_mma(x, w)  # noqa: B023
            for tiles, split in ROWS_TILINGS:
                label = "/".join(map(str, tiles)) + f" split {split or 'plan'}"
                methods[label] = functools.partial(_rows_mma_tiled, x, tiles=tiles, split=split)
            for label, fn in methods.items():
                err = ((fn(weights[0]).float() - want).abs().max() / want.abs().max()).item()
                us = replay_us(fn, weights, device)
                row.append(f"{label} {us:6.1f} ({floor_us / us:4.0%}, err {err:.0e})")
            print("  ".join(row), flush=True)
        del weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", help="rows a product (2-64)")
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device, torch.bfloat16).copy_gbps
    print(f"copy {copy_gbps:.0f} GB/s")
    if args.rows:
        rows_table(args.shapes, args.rows, copy_gbps)
        return
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
        methods = {
            "linear": lambda w: F.linear(x, w),  # noqa: B023
            "mv": lambda w: torch.mv(w, x[0]),  # noqa: B023
            "matmul_t": lambda w: (w @ x.t()).t(),  # noqa: B023
            "triton": lambda w: gemv(x, w),  # noqa: B023
        }
        want = F.linear(x, weights[0]).float()
        row = [f"{name:16s} floor {floor_us:7.1f} us"]
        for label, fn in methods.items():
            got = fn(weights[0]).reshape(1, n).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            us = replay_us(fn, weights, device)
            row.append(f"{label} {us:7.1f} us ({floor_us / us:4.0%}, err {err:.0e})")
        print("  ".join(row), flush=True)
        del weights


if __name__ == "__main__":
    main()
