# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""A split-K Triton FP8 GEMV (engine/layers/quantization/triton_fp8.py `fp8_gemv`) against
cuBLASLt's scaled GEMM at decode sizes, Llama-3-8B shapes, with a few tilings; correctness
against the scaled GEMM first.

First run (session 12, H100): correct (3-7e-3 of the scaled GEMM) but timed eagerly, so launch
bound (the GEMV is 4 launches: zeros, kernel, scale, cast; 65-240 us against 22-51 for
`_scaled_mm`). TODO next: time in CUDA graphs (as bench/fp8_linear.py), fuse the scales and
the cast into the kernel (a reduction over splits in place of float32 atomics).

    bench/device_env.sh python3 bench/fp8_gemv.py
"""

from __future__ import annotations

import torch

from kvfleet.bench.ceilings import median_seconds
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 20
TILINGS = [(64, 256, 4), (32, 256, 8), (64, 128, 8), (128, 128, 4), (32, 512, 4), (64, 256, 16)]


def main() -> None:
    device = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        weights = [quantize_rows(torch.randn(n, k, device=device)) for _ in range(COPIES)]
        for m in (1, 4, 16):
            x_q, x_s = quantize_rows(torch.randn(m, k, device=device, dtype=torch.bfloat16))
            want = torch._scaled_mm(
                x_q, weights[0][0].t(), scale_a=x_s, scale_b=weights[0][1].t(),
                out_dtype=torch.bfloat16,
            ).float()  # fmt: skip
            cublas = median_seconds(
                lambda: [
                    torch._scaled_mm(
                        x_q, w.t(), scale_a=x_s, scale_b=s.t(), out_dtype=torch.bfloat16
                    )
                    for w, s in weights
                ],
                device,
            )
            floor_us = n * k / 2.99e12 * 1e6
            cublas_us = cublas / COPIES * 1e6
            line = f"{name:8s} M={m:3d}: scaled_mm {cublas_us:6.1f} us, floor {floor_us:5.1f}"
            for bn, bk, splits in TILINGS:
                got = fp8_gemv(
                    x_q, x_s, weights[0][0], weights[0][1], torch.bfloat16, bn, bk, splits
                ).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                t = median_seconds(
                    lambda: [
                        fp8_gemv(x_q, x_s, w, s, torch.bfloat16, bn, bk, splits) for w, s in weights
                    ],
                    device,
                )
                line += f" | {bn}/{bk}/{splits}: {t / COPIES * 1e6:6.1f} ({err:.0e})"
            print(line)


if __name__ == "__main__":
    main()
