"""Batch-1 matmuls (GEMV) in bf16 at the weight shapes of decode steps (Llama-3-70B over two GPUs,
Llama-3-8B, Qwen3-30B-A3B's attention and router): cuBLAS through F.linear against torch.mv
(cuBLAS's matrix-vector path) and the Triton GEMV (engine/layers/triton_gemv.py, launched
dependent where the GPU can: consecutive calls overlap as consecutive layers do), in CUDA
graphs of 20 calls over distinct weights (no cache reuse), beside the copy bandwidth. The LM
heads (128k-152k words) stay with cuBLAS in the engine (`linear.TRITON_GEMV_MAX_BYTES`); they
are timed here to say whether they should not.

    bench/device_env.sh python3 bench/gemv.py [--shapes 8b-lm-head ...] [--methods triton]
        [--tiles 8,512,4,3 ...]

`--tiles BLOCK_N,BLOCK_K,warps,stages`: the Triton GEMV also at these tiles (`gemv(tiles=)`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.layers.triton_gemv import gemv

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
    "qwen3-8b-gate_up": (24576, 4096),
    "qwen3-8b-down": (4096, 12288),
    "30b-a3b-qkv": (5120, 2048),
    "30b-a3b-o": (2048, 4096),
    "30b-a3b-router": (128, 2048),
    "8b-lm-head": (128256, 4096),
    "30b-a3b-lm-head": (151936, 2048),
    "1b-qkv": (3072, 2048),
    "1b-o": (2048, 2048),
    "1b-down": (2048, 8192),
    "phi3-qkv": (9216, 3072),
    "phi3-o": (3072, 3072),
    "phi3-gate_up": (16384, 3072),
    "phi3-down": (3072, 8192),
    "phi3-lm-head": (32064, 3072),
    "qwen2.5-gate_up": (37888, 3584),
    "gemma3-gate_up": (30720, 3840),
    "gemma3-lm-head": (262208, 3840),
}
COPIES = 20


METHODS = ("linear", "mv", "matmul_t", "triton")


def _tiles(text: str) -> tuple[int, int, int, int]:
    """`--tiles` BLOCK_N,BLOCK_K,warps,stages: four positive integers, the blocks and warps
    powers of two (Triton's ranges and launches take no others)."""
    want = f"{text!r}: want BLOCK_N,BLOCK_K,warps,stages, positive, all but stages powers of two"
    try:
        parts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(want) from None
    if len(parts) != 4 or min(parts) < 1 or any(v & (v - 1) for v in parts[:3]):
        raise argparse.ArgumentTypeError(want)
    return parts[0], parts[1], parts[2], parts[3]


def _at_tiles(
    x: torch.Tensor, tiles: tuple[int, int, int, int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: gemv(x, w, tiles=tiles)


def replay_us(
    fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], device: torch.device
) -> float:
    """us a call of fn over COPIES weights in one CUDA graph (median replay)."""
    replay = captured(lambda: [fn(w) for w in weights])
    return median_seconds(replay, device, repeats=20) * 1e6 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--tiles", nargs="*", default=[], type=_tiles)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device, torch.bfloat16).copy_gbps
    print(f"copy {copy_gbps:.0f} GB/s")
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        floor_us = n * k * 2 / (copy_gbps * 1e9) * 1e6
        every = {
            "linear": lambda w: F.linear(x, w),  # noqa: B023
            "mv": lambda w: torch.mv(w, x[0]),  # noqa: B023
            "matmul_t": lambda w: (w @ x.t()).t(),  # noqa: B023
            "triton": lambda w: gemv(x, w),  # noqa: B023
        }
        methods = {label: every[label] for label in args.methods}
        for tiles in args.tiles:
            methods["/".join(map(str, tiles))] = _at_tiles(x, tiles)
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
