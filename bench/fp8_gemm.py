# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The FP8 GEMM at decode-step and prompt row counts: cuBLASLt's scaled GEMM
(`torch._scaled_mm`) against the Triton GEMM (engine/layers/quantization/triton_fp8.py
`fp8_gemm`: its tiles as shipped, `fp8_gemm_tiles`, then over a few tilings, and from 128
rows with K split in parts) and, up to 64 rows,
the tensor-core GEMV over quantized rows (engine/layers/triton_gemv.py `fp8_rows_mma`: its plan
as shipped, then other K tiles and splits), at Llama-3-8B's shapes, on rows already quantized
(the producers quantize them: `QuantizedRows`). Each
timing is a CUDA graph over 20 weight copies (weights from HBM, not L2), per call; beside it
the floor: the larger of the bytes (weights + rows + output) at the copy bandwidth and the
FLOPs at the FP8 matmul peak, both measured in the same run. Each tiling's largest
difference from cuBLASLt's output, relative to its largest magnitude, comes first.

    bench/device_env.sh python3 bench/fp8_gemm.py [--rows 256 2048]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvfleet.bench.ceilings import captured, fp8_matmul_tflops, measure_ceilings
from kvfleet.bench.fp8_linear import replay_us
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemm
from kvfleet.engine.layers.triton_gemv import MMA_MAX_ROWS, fp8_mma_plan, fp8_rows_mma

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 20
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
TILINGS = [
    (64, 64, 128, 4, 4),
    (64, 128, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (128, 128, 128, 8, 3),
    (128, 128, 128, 4, 4),
    (128, 256, 128, 8, 3),
    (64, 256, 128, 4, 3),
]
# Tilings with K split in parts, from 128 rows (where qkv, o and down give 64-96 output tiles
# of 128 x 128 to 132 SMs): (tiles, parts)
SPLIT_TILINGS: list[tuple[tuple[int, int, int, int, int], int]] = [
    ((128, 128, 128, 8, 3), 2),
    ((128, 128, 128, 8, 3), 4),
    ((128, 256, 128, 8, 3), 2),
    ((64, 128, 128, 4, 4), 2),
    ((128, 64, 128, 4, 4), 2),
]
# The tensor-core GEMV's (BLOCK_N, BLOCK_K, warps) and split (None: its plan's) beside its plan
MMA_TILINGS: list[tuple[tuple[int, int, int], int | None]] = [
    ((64, 256, 4), None),
    ((64, 512, 4), None),
    ((64, 256, 4), 16),
    ((128, 256, 4), None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 1024, 8192])
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device, torch.bfloat16).copy_gbps
    peak = fp8_matmul_tflops(device)
    print(f"copy {copy_gbps:.0f} GB/s, FP8 matmul {peak:.0f} TFLOP/s; us per call")
    for name, (n, k) in SHAPES.items():
        weights = [quantize_rows(torch.randn(n, k, device=device) * 0.02) for _ in range(COPIES)]
        for m in args.rows:
            x_q, x_scale = quantize_rows(torch.randn(m, k, device=device))
            floor_us = max(
                (n * k + m * k + 2 * m * n) / (copy_gbps * 1e3), 2 * m * n * k / (peak * 1e6)
            )

            def cublas(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
                return torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=s.t(),
                                        out_dtype=torch.bfloat16)  # fmt: skip

            want = cublas(*weights[0]).float()
            us = replay_us(captured(lambda: [cublas(w, s) for w, s in weights]), COPIES)
            line = f"{name:8s} M={m:5d}: floor {floor_us:7.1f} | cuBLASLt {us:7.1f}"
            gemms = [("triton", None)] + [("/".join(map(str, t)), t) for t in TILINGS]
            for label, tiles in gemms:
                line += _timed(label, want, weights, lambda w, s: fp8_gemm(
                    x_q, x_scale, w, s, None, torch.bfloat16, tiles))  # fmt: skip
            if m >= 128:
                for tiles, parts in SPLIT_TILINGS:
                    label = "/".join(map(str, tiles)) + f" split {parts}"
                    line += _timed(label, want, weights, lambda w, s: fp8_gemm(
                        x_q, x_scale, w, s, None, torch.bfloat16, tiles, parts))  # fmt: skip
            if m <= MMA_MAX_ROWS:
                for mma, split in [(None, None), *MMA_TILINGS]:
                    plan = fp8_mma_plan(n, k, device, mma, split, m)
                    label = "mma " + "/".join(map(str, (plan[0], plan[1], plan[4]))) + (
                        f" split {plan[3]}")  # fmt: skip
                    line += _timed(label, want, weights, lambda w, s: fp8_rows_mma(
                        x_q, x_scale, w, s, None, torch.bfloat16, mma, split))  # fmt: skip
            print(line)


def _timed(
    label: str,
    want: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> str:
    """The line's part for `run(weight, scale)` over the weight copies: its time, its error."""
    try:
        got = run(*weights[0]).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        replay = captured(lambda: [run(w, s) for w, s in weights])
        return f" | {label} {replay_us(replay, COPIES):7.1f} ({err:.0e})"
    except Exception as exc:  # (a tiling that does not fit: say so, go on)
        return f" | {label} failed {type(exc).__name__}"


if __name__ == "__main__":
    main()
