# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
"""The e4m3 one-row tensor-core GEMV (`triton_gemv.fp8_gemv_mma`) over its K tile, K split and
the K loop's pipeline stages at Llama-3-8B's four layers, qkv and gate_up with their RMSNorm
made inside as the engine runs them: a stage buffers a [64, BLOCK_K] weight tile in shared
memory, so stages and BLOCK_K set how many programs an SM holds and whether all of a layer's
programs run in one round (the shipped plan's 3 stages: gate_up's 448 programs of ~108 KB, two
an SM, two rounds). Each timed in a CUDA graph over 20 weight copies beside the bytes floor,
checked against cuBLASLt's scaled GEMM; then the batch-1 layer chain (bench/gemv_chain.py's,
norms in the GEMVs) with each layer's fastest against the shipped plan, alternating.

    bench/device_env.sh python3 bench/fp8_gemv_stages.py
"""

from __future__ import annotations

from typing import Any

import torch

from kvfleet.bench.ceilings import captured, measure_ceilings
from kvfleet.bench.fp8_linear import replay_us
from kvfleet.bench.gemv_chain import HIDDEN, SHAPES, fused_chain, layer_us, random_layers
from kvfleet.engine.layers import triton_gemv
from kvfleet.engine.layers.linear import UnnormalizedRow
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.triton_layers import add_rms_norm

COPIES = 20
SPLITS = {"qkv": (2, 4, 8), "o": (4, 8, 16), "gate_up": (1, 2), "down": (4, 8, 16)}
BLOCKS_K = (128, 256, 512)
STAGES = (1, 2, 3, 4)
NORMED = ("qkv", "gate_up")  # (the layers the engine hands an `UnnormalizedRow`)
Config = tuple[int, int, int]  # (BLOCK_K, split, stages)


def _row(name: str, k: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """(what the engine hands the layer: a row, or x + residual to normalize; the row)."""
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    if name not in NORMED:
        return x, x
    residual = torch.randn_like(x)
    weight = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
    row = UnnormalizedRow(x, residual, weight, 1e-5, False, torch.empty_like(x))
    return row, add_rms_norm(x, residual, weight, 1e-5)[0]


def sweep(name: str, n: int, k: int, copy_gbps: float) -> Config:
    device = torch.device("cuda")
    weights = [quantize_rows(torch.randn(n, k, device=device) * 0.02) for _ in range(COPIES)]
    x, plain = _row(name, k, device)
    x_q, x_s = quantize_rows(plain)
    want = torch._scaled_mm(x_q, weights[0][0].t(), scale_a=x_s, scale_b=weights[0][1].t(),
                            out_dtype=torch.float32)  # fmt: skip
    floor_us = n * k / (copy_gbps * 1e9) * 1e6
    shipped = replay_us(captured(lambda: [triton_gemv.fp8_gemv_mma(x, w, s)
                                          for w, s in weights]), COPIES)  # fmt: skip
    plan = triton_gemv.fp8_mma_plan(n, k, device)
    print(f"{name:8s} floor {floor_us:5.1f} | shipped {plan} stages {triton_gemv.MMA_STAGES}: "
          f"{shipped:5.1f}", flush=True)  # fmt: skip
    best: tuple[float, Config] = (shipped, (plan[1], plan[3], triton_gemv.MMA_STAGES))
    for block_k in BLOCKS_K:
        for split in SPLITS[name]:
            if triton_gemv.fp8_mma_plan(n, k, device, (64, block_k, 4), split)[3] != split:
                continue
            for stages in STAGES:
                config = (block_k, split, stages)
                try:
                    got = triton_gemv.fp8_gemv_mma(x, *weights[0], tiles=(64, block_k, 4),
                                                   split=split, stages=stages).float()  # fmt: skip
                    err = ((got - want).norm() / want.norm()).item()
                    us = replay_us(captured(lambda: [
                        triton_gemv.fp8_gemv_mma(x, w, s, tiles=(64, block_k, 4), split=split,
                                                 stages=stages)
                        for w, s in weights]), COPIES)  # fmt: skip
                except Exception as exc:  # (a tiling that does not fit: say so, go on)
                    print(f"   {config}: {type(exc).__name__} {exc}"[:160])
                    continue
                print(f"   BLOCK_K {block_k} split {split} stages {stages}: {us:5.1f} "
                      f"(err {err:.1e})")  # fmt: skip
                if err < 1e-2 and us < best[0]:
                    best = (us, config)
    print(f"== {name}: floor {floor_us:.1f} | shipped {shipped:.1f} | best {best[0]:.1f} "
          f"(BLOCK_K, split, stages) {best[1]}", flush=True)  # fmt: skip
    return best[1]


def chain(configs: dict[tuple[int, int], Config], copy_gbps: float) -> None:
    """The fused chain with every layer at its fastest `sweep` choice, against `gemv` as
    shipped (each of the chain's layers on the tensor-core GEMV, without rotary), alternating."""
    device = torch.device("cuda")
    x = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    layers = random_layers(quantize_rows, device)
    floor = sum(n * k for n, k in SHAPES.values()) / (copy_gbps * 1e9) * 1e6

    def tuned(x: Any, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        block_k, split, stages = configs[(w[0].shape[0], w[0].shape[1])]
        return triton_gemv.fp8_gemv_mma(x, *w, tiles=(64, block_k, 4), split=split, stages=stages)

    def shipped(x: Any, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return triton_gemv.gemv(x, *w)

    outputs = {}
    for round_ in range(3):
        for label, linear in (("tuned", tuned), ("shipped", shipped)):

            def step(linear: Any = linear) -> torch.Tensor:
                return fused_chain(layers, linear, x, norm)

            us = layer_us(step, device)
            outputs[label] = step().float()
            print(f"chain round {round_}, {label:7s}: {us:6.1f} us a layer "
                  f"({floor / us:5.1%} of {floor:.1f})", flush=True)  # fmt: skip
    diff = (outputs["tuned"] - outputs["shipped"]).norm() / outputs["shipped"].norm()
    print(f"chain output, tuned against shipped: relative difference {diff.item():.1e}")


def main() -> None:
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device, torch.bfloat16).copy_gbps
    print(f"copy {copy_gbps:.0f} GB/s; us a call (median of 15 graph replays / {COPIES})")
    configs = {(n, k): sweep(name, n, k, copy_gbps) for name, (n, k) in SHAPES.items()}
    chain(configs, copy_gbps)


if __name__ == "__main__":
    main()
