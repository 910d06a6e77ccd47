"""How far long one-sign e4m3 sums drift on the GPU, each FP8 path beside cuBLASLt (fast
accumulation off and on): K = 14,336 (Llama-3-8B's down projection), N = 4,096, inputs and
weights U[0, 1) quantized per row, float32 out, relative error against float64 (mean, max).
Hopper's e4m3 MMAs keep fewer bits than float32 in their sums: a kernel that lets them run over
the whole of K drifts low (bench/RESULTS.md "2026-11-28 (session 26)").

    bench/device_env.sh python3 bench/fp8_sums.py
"""

from __future__ import annotations

import torch

from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemm
from kvfleet.engine.layers.triton_gemv import MMA_MAX_ROWS, fp8_gemv_mma, fp8_rows_mma


def main() -> None:
    torch.manual_seed(0)
    n, k = 4096, 14336
    w_q, w_s = quantize_rows(torch.rand(n, k, device="cuda") * 0.02)
    for m in (1, 7, 16, 64, 2048):
        x = torch.rand(m, k, device="cuda")
        x_q, x_s = quantize_rows(x)
        want = (x_q.double() * x_s.double()) @ (w_q.double() * w_s.double()).t()
        outs = {"float32 matmul, dequantized": (x_q.float() * x_s) @ (w_q.float() * w_s).t()}
        for fast in (False, True):
            outs[f"cuBLASLt use_fast_accum={fast}"] = torch._scaled_mm(
                x_q, w_q.t(), scale_a=x_s, scale_b=w_s.t(), out_dtype=torch.float32,
                use_fast_accum=fast,
            )  # fmt: skip
        outs["Triton GEMM"] = fp8_gemm(x_q, x_s, w_q, w_s, None, torch.float32)
        if m <= MMA_MAX_ROWS:
            outs["tensor-core GEMV, rows"] = fp8_rows_mma(x_q, x_s, w_q, w_s, None, torch.float32)
        if m == 1:
            outs["tensor-core GEMV, one row"] = fp8_gemv_mma(x, w_q, w_s)
        for name, out in outs.items():
            rel = (out.double() - want) / want
            print(f"m={m:5d} {name:30s} mean {rel.mean().item():+.2e} "
                  f"max |.| {rel.abs().max().item():.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
