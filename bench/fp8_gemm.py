# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The FP8 GEMM at decode-step and prompt row counts: cuBLASLt's scaled GEMM
(`torch._scaled_mm`, what `Fp8Linear` runs today) against the Triton GEMM
(engine/layers/quantization/triton_fp8.py `fp8_gemm`) over a few tilings, at Llama-3-8B's
shapes, on rows already quantized (the producers quantize them: `QuantizedRows`). Each
timing is a CUDA graph over 20 weight copies (weights from HBM, not L2), per call; beside it
the floor: the larger of the bytes (weights + rows + output) at the copy bandwidth and the
FLOPs at the FP8 matmul peak, both measured in the same run. Each tiling's largest
difference from cuBLASLt's output, relative to its largest magnitude, comes first.

    bench/device_env.sh python3 bench/fp8_gemm.py [--rows 256 2048]
"""

from __future__ import annotations

import argparse

import torch

from kvfleet.bench.ceilings import fp8_matmul_tflops, measure_ceilings
from kvfleet.bench.fp8_linear import graphed, replay_us
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemm

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
            us = replay_us(graphed(lambda: [cublas(w, s) for w, s in weights]), COPIES)
            line = f"{name:8s} M={m:5d}: floor {floor_us:7.1f} | cuBLASLt {us:7.1f}"
            for tiles in TILINGS:
                try:
                    got = fp8_gemm(x_q, x_scale, *weights[0], None, torch.bfloat16, tiles)
                    err = ((got.float() - want).abs().max() / want.abs().max()).item()
                    graph = graphed(
                        lambda: [
                            fp8_gemm(x_q, x_scale, w, s, None, torch.bfloat16, tiles)
                            for w, s in weights
                        ]
                    )
                    label = "/".join(map(str, tiles))
                    line += f" | {label} {replay_us(graph, COPIES):7.1f} ({err:.0e})"
                except Exception as exc:  # (a tiling that does not fit: say so, go on)
                    line += f" | {'/'.join(map(str, tiles))} failed {type(exc).__name__}"
            print(line)


if __name__ == "__main__":
    main()
