# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The Triton W4A16 kernels (engine/layers/quantization/triton_packed.py) against bf16 F.linear at
Llama-3-8B's shapes, each timed inside a CUDA graph over 20 weight copies (so the weights come
from HBM, not L2), beside the 4-bit weights' bytes floor (values, scales and zeros; group 128):
the one-row split-K kernel over a sweep of (BLOCK_N, BLOCK_K, STEPS, warps), more rows
through the slice GEMM over (BLOCK_M, BLOCK_N, R, STEPS, warps) and through the dequantizing pass +
cuBLAS; each checked against the reference first. `--group 32`: 4-bit values in groups of 32
(GGUF Q4's); `--bits 8`: 8-bit values in GGUF Q8_0's form (group 32, zero 128).

    bench/device_env.sh python3 bench/int4_gemm.py [--bits 8 | --group 32] [--rows 1 8]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.layers.quantization.packed import (
    PackedWeights,
    pack_rows,
    packed_linear_reference,
    quantize_rtn,
)
from kvfleet.engine.layers.quantization.triton_packed import (
    dequantize_triton,
    packed_gemm,
    packed_gemv,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 20
GEMM_SWEEP = [(16, 64, 32, 4, 4), (32, 64, 32, 2, 4), (64, 64, 32, 2, 4)]
SWEEP = [(64, 128, 1, 4), (64, 128, 3, 4), (32, 128, 2, 2), (64, 64, 4, 4), (128, 128, 2, 4),
         (128, 128, 1, 4), (128, 128, 2, 8), (256, 128, 1, 8), (64, 128, 4, 4), (32, 128, 4, 2),
         (128, 64, 2, 4), (64, 128, 2, 2), (128, 128, 4, 8), (64, 128, 8, 4), (64, 128, 6, 4),
         (32, 128, 8, 2), (128, 128, 8, 8), (128, 128, 4, 4), (128, 64, 8, 2)]  # fmt: skip
# (groups of 32: a step takes one group)
SWEEP_32 = [(64, 32, 4, 4), (64, 32, 8, 4), (128, 32, 4, 4), (128, 32, 8, 4), (64, 32, 16, 4),
            (32, 32, 8, 2), (256, 32, 4, 8)]  # fmt: skip


def q8_0_like(dense: torch.Tensor) -> PackedWeights:
    """`dense` [N, K] as GGUF's Q8_0 holds it: a scale per 32 inputs, bytes q + 128."""
    n, k = dense.shape
    grouped = dense.float().t().reshape(k // 32, 32, n)
    scales = (grouped.abs().amax(dim=1) / 127).clamp_min(1e-10)
    q = (grouped / scales[:, None, :]).round().clamp(-128, 127) + 128
    zeros = torch.full_like(scales, 128.0)
    bf16 = torch.bfloat16
    return PackedWeights(pack_rows(q.reshape(k, n), 8), scales.to(bf16), zeros.to(bf16), 32, bits=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group", type=int, choices=(32, 128), default=128)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 32, 64])
    args = parser.parse_args()
    bits, group = args.bits, 32 if args.bits == 8 else args.group
    sweep = SWEEP if group == 128 else SWEEP_32
    device = torch.device("cuda")
    copy = measure_ceilings(device, torch.bfloat16).copy_gbps * 1e9
    print(f"copy {copy / 1e9:.0f} GB/s; us per call (median graph replay / {COPIES})")
    for name, (n, k) in SHAPES.items():
        dense = [
            torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)
        ]
        if bits == 8:
            weights = [q8_0_like(w) for w in dense]
            floor = (n * k + 2 * 2 * n * (k // 32)) / copy * 1e6
        else:
            weights = [quantize_rtn(w, group, torch.bfloat16) for w in dense]
            floor = (n * k / 2 + 2 * 2 * n * (k // group)) / copy * 1e6

        def timed(fn: Callable[[], object]) -> float:
            return median_seconds(captured(fn), device, repeats=15) / COPIES * 1e6

        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = packed_linear_reference(x, weights[0]).float()
            bf16 = timed(lambda: [F.linear(x, w) for w in dense])
            line = f"{name:8s} M={m:4d}: floor {floor:5.1f} | bf16 {bf16:6.1f}"
            if m > 1:
                us = timed(lambda: [x @ dequantize_triton(w, x.dtype) for w in weights])
                line += f" | dequantize + cuBLAS {us:6.1f}"
                for tiles in [None, *(GEMM_SWEEP if bits == 4 else [])]:
                    if tiles is not None and tiles[0] > max(16, 2 * m):
                        continue
                    got = packed_gemm(x, weights[0], None, tiles).float()
                    err = ((got - want).norm() / want.norm()).item()
                    us = timed(lambda: [packed_gemm(x, w, None, tiles) for w in weights])
                    label = "/".join(map(str, tiles)) if tiles else "default"
                    line += f" | {label} {us:6.1f} ({err:.0e})"
            else:
                for gemv_tiles in [None, *sweep]:
                    got = packed_gemv(x, weights[0], None, gemv_tiles).float()
                    err = ((got - want).norm() / want.norm()).item()
                    us = timed(lambda: [packed_gemv(x, w, None, gemv_tiles) for w in weights])
                    label = "/".join(map(str, gemv_tiles)) if gemv_tiles else "default"
                    line += f" | {label} {us:6.1f} ({err:.0e})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
