# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The fused Triton FP8 GEMV (engine/layers/triton_gemv.py `gemv` over e4m3 weights: the
activation's per-row quantization and both scales inside one kernel) against the unfused path
(the Triton row quantization, then cuBLASLt's scaled GEMM) and bf16 `F.linear`, at decode row
counts and Llama-3-8B shapes, each timed inside a CUDA graph (20 weight copies per replay, so
the weights come from HBM, not L2), beside the bytes floor; a few tilings of the GEMV; its
agreement with the unfused path first; the tensor-core GEMV (`fp8_gemv_mma`) over tilings and
the number of parts K is cut into.

    bench/device_env.sh python3 bench/fp8_gemv.py [--shapes o down] [--tiles 8,2048,4,3 ...]
        [--mma 16,512,4 ...] [--w8a8]

(`--tiles`: the CUDA-core kernel's (BLOCK_N, BLOCK_K, warps, stages) instead of TILINGS;
`--mma`: the tensor-core GEMV's (BLOCK_N, BLOCK_K, warps) instead of MMA_TILINGS; `--w8a8`: the
shipped GEMV and the CUDA-core tilings quantize the row first, `triton_gemv.FP8_BF16_ROW` off.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvfleet.bench.ceilings import captured, measure_ceilings
from kvfleet.bench.fp8_linear import replay_us
from kvfleet.engine.layers import triton_gemv
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton
from kvfleet.engine.layers.triton_gemv import fp8_gemv_mma, fp8_mma_plan, gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 20
# (BLOCK_N, BLOCK_K, warps) of the tensor-core GEMV (`fp8_gemv_mma`), each with K cut into
# each of MMA_SPLITS parts that its tiles allow; the CUDA-core kernel's (BLOCK_N, BLOCK_K,
# warps, stages) after
MMA_TILINGS = [(64, 256, 4), (64, 512, 4)]
MMA_SPLITS = (1, 2, 4, 7, 8, 14, 16)
TILINGS = [(8, 512, 4, 3), (16, 512, 4, 3), (8, 1024, 4, 3), (4, 1024, 4, 4), (16, 256, 4, 4),
           (8, 512, 8, 4), (4, 512, 2, 4), (32, 256, 8, 3)]  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tiles", nargs="*", type=_ints, default=TILINGS)
    parser.add_argument("--mma", nargs="*", type=_ints, default=MMA_TILINGS)
    parser.add_argument("--w8a8", action="store_true", help="triton_gemv.FP8_BF16_ROW off")
    args = parser.parse_args()
    triton_gemv.FP8_BF16_ROW = not args.w8a8
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device, torch.bfloat16).copy_gbps
    print(f"copy {copy_gbps:.0f} GB/s; per call, us (median of 15 graph replays / {COPIES})")
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [quantize_rows(torch.randn(n, k, device=device) * 0.02) for _ in range(COPIES)]
        bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(COPIES)]
        floor_us = n * k / (copy_gbps * 1e9) * 1e6
        for m in (1,):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

            def unfused() -> list[torch.Tensor]:
                out = []
                for w, s in weights:
                    x_q, x_s = quantize_rows_triton(x)
                    out.append(torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=s.t(),
                                                out_dtype=torch.bfloat16))  # fmt: skip
                return out

            want = unfused()[0].float()
            bf16_us = replay_us(captured(lambda: [F.linear(x, w) for w in bf16]), COPIES)
            unfused_us = replay_us(captured(unfused), COPIES)
            line = (
                f"{name:8s} M={m}: floor {floor_us:5.1f} | bf16 {bf16_us:6.1f} "
                f"(floor {2 * floor_us:5.1f}) | quant+scaled_mm {unfused_us:6.1f}"
            )
            static = torch.ones(1, device=device)  # (a checkpoint's input scale: no amax)
            for label, x_scale in (("shipped", None), ("static scale", static)):
                replay = captured(lambda: [gemv(x, w, s, x_scale=x_scale) for w, s in weights])
                line += f" | {label}: {replay_us(replay, COPIES):5.1f}"
            for mma in args.mma:
                for split in MMA_SPLITS:
                    plan = fp8_mma_plan(n, k, device, mma, split)
                    if plan[3] != split:  # (K's tiles do not cut into that many parts)
                        continue
                    label = "/".join(map(str, mma))
                    try:  # (a tiling Triton cannot compile for this GPU is reported, not fatal)
                        got = fp8_gemv_mma(x, *weights[0], tiles=mma, split=split).float()
                    except Exception as error:
                        line += f" | mma {label} split {split}: {type(error).__name__}"
                        continue
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    replay = captured(
                        lambda: [fp8_gemv_mma(x, w, s, tiles=mma, split=split) for w, s in weights]
                    )
                    us = replay_us(replay, COPIES)
                    line += f" | mma {label} split {split}: {us:5.1f} ({err:.0e})"
            for bn, bk, warps, stages in args.tiles:
                tiles = (bn, bk, warps, stages)
                got = gemv(x, *weights[0], tiles=tiles).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                replay = captured(lambda: [gemv(x, w, s, tiles=tiles) for w, s in weights])
                line += (
                    f" | {bn}/{bk}/{warps}/{stages}: {replay_us(replay, COPIES):5.1f} ({err:.0e})"
                )
            print(line)


if __name__ == "__main__":
    main()
