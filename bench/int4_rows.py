# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The one-row 4-bit GEMV two ways at Llama-3-8B's shapes: the split-K kernel
(`triton_packed._packed_gemv_kernel`, its default tiles: "split-K"), whole columns to a thread
(`triton_packed_rows`, over a sweep of (BLOCK_N, ROWS, warps[, CHUNK])) and what
`packed_gemv` takes by the layer's shape ("plan"), each checked against the dequantized
reference, timed inside a CUDA graph over 20 weight copies beside the 4-bit bytes floor
(int4_gemm.py's method).

    bench/device_env.sh python3 bench/int4_rows.py [--group 32] [--shapes ...] [--tiles ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.layers.quantization import triton_packed
from kvfleet.engine.layers.quantization.packed import packed_linear_reference, quantize_rtn
from kvfleet.engine.layers.quantization.triton_packed_rows import packed_gemv_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 20
# (BLOCK_N, ROWS, warps[, CHUNK]): 4-row chunks as named rows, or CHUNK-row tiles
SWEEP = [(256, 16, 1), (256, 32, 2), (128, 32, 1), (256, 32, 1, 8), (256, 64, 1, 8),
         (256, 32, 2, 8), (256, 64, 2, 8), (128, 32, 1, 8), (128, 64, 1, 8), (512, 64, 2, 8),
         (256, 16, 1, 8), (256, 64, 2, 16), (128, 64, 1, 16), (256, 128, 2, 16)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--group", type=int, choices=(32, 128), default=128)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--tiles", nargs="+", help="BLOCK_N,ROWS,warps[,CHUNK] ... (the sweep)")
    args = parser.parse_args()
    sweep = [tuple(int(v) for v in t.split(",")) for t in args.tiles] if args.tiles else SWEEP
    device = torch.device("cuda")
    copy = measure_ceilings(device, torch.bfloat16).copy_gbps * 1e9
    print(f"copy {copy / 1e9:.0f} GB/s; us per call (median graph replay / {COPIES})")
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [
            quantize_rtn(torch.randn(n, k, device=device) * 0.02, args.group, torch.bfloat16)
            for _ in range(COPIES)
        ]
        floor = (n * k / 2 + 2 * 2 * n * (k // args.group)) / copy * 1e6
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        want = packed_linear_reference(x, weights[0]).float()

        def timed(fn: Callable[[], object]) -> float:
            return median_seconds(captured(fn), device, repeats=15) / COPIES * 1e6

        line = f"{name:8s} floor {floor:5.1f}"
        for label, rows_gemv in (("split-K", False), ("plan", True)):
            triton_packed.ROWS_GEMV = rows_gemv
            got = triton_packed.packed_gemv(x, weights[0]).float()
            err = ((got - want).norm() / want.norm()).item()
            us = timed(lambda: [triton_packed.packed_gemv(x, w) for w in weights])
            line += f" | {label} {us:6.1f} ({err:.0e})"
        for tiles in sweep:
            got = packed_gemv_rows(x, weights[0], None, tiles).float()
            err = ((got - want).norm() / want.norm()).item()
            us = timed(lambda: [packed_gemv_rows(x, w, None, tiles) for w in weights])
            line += f" | {'/'.join(map(str, tiles))} {us:6.1f} ({err:.0e})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
