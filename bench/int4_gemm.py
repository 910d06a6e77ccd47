# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The Triton W4A16 GEMM (engine/layers/quantization/triton_int4.py) against bf16 F.linear at
Llama-3-8B's shapes, in CUDA graphs, beside the 4-bit weights' bytes floor (group 128).

    bench/device_env.sh python3 bench/int4_gemm.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench_cudagraph

from kvfleet.bench.ceilings import measure_ceilings
from kvfleet.engine.layers.quantization.int4 import Int4Weights, pack_rows
from kvfleet.engine.layers.quantization.triton_int4 import w4a16_matmul

TILES = [(16, 128, 4), (32, 128, 4), (16, 64, 2), (32, 64, 4), (8, 128, 2), (64, 64, 4)]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def main() -> None:
    device = torch.device("cuda")
    copy = measure_ceilings(device, torch.bfloat16).copy_gbps * 1e9
    print(f"copy {copy / 1e9:.0f} GB/s; us per call")
    for name, (k, n) in SHAPES.items():
        weights = Int4Weights(
            pack_rows(torch.randint(0, 16, (k, n), device=device)),
            torch.rand(k // 128, n, device=device).bfloat16(),
            torch.rand(k // 128, n, device=device).bfloat16(),
            128,
        )
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        floor = (k * n / 2 + 2 * (k // 128) * n * 2) / copy * 1e6
        for m in (1, 16, 256):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            int4 = do_bench_cudagraph(lambda: w4a16_matmul(x, weights)) * 1e3
            bf16 = do_bench_cudagraph(lambda: torch.nn.functional.linear(x, dense)) * 1e3
            line = f"{name:8s} M={m:4d}: W4A16 {int4:7.1f} (floor {floor:5.1f}) | bf16 {bf16:7.1f}"
            if m == 1:  # (the one-row kernel's tiles: BLOCK_N/BLOCK_K/warps)
                for bn, bk, warps in TILES:
                    t = do_bench_cudagraph(lambda: w4a16_matmul(x, weights, bn, bk, warps)) * 1e3
                    line += f" | {bn}/{bk}/{warps} {t:6.1f}"
            print(line)


if __name__ == "__main__":
    main()
