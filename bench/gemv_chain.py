"""A batch-1 layer's chain of the engine's kernels at Llama-3-8B's shapes (residual add + norm,
the qkv and o GEMVs, add + norm, gate_up, SiLU x mul, down; bf16 through the engine's `Linear`
(cuBLAS, or the Triton GEMV where it takes the weight), FP8 or 4-bit weights), launched
normally and launched dependent (engine/layers/dependent_launch.py), each in a CUDA graph over
16 layers of distinct weights (so they come from HBM): us per layer beside the weights' bytes
floor at the copy bandwidth measured in the same run. Then, launched dependent, the chain as
the engine runs it now for bf16 and FP8: each add + norm made by the GEMV after it
(`UnnormalizedRow`).

    bench/device_env.sh python3 bench/gemv_chain.py
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.layers import dependent_launch as pdl
from kvfleet.engine.layers.linear import Linear, UnnormalizedRow
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.quantization.packed import quantize_rtn
from kvfleet.engine.layers.quantization.triton_packed import packed_gemv
from kvfleet.engine.layers.triton_gemv import gemv
from kvfleet.engine.layers.triton_layers import act_and_mul, add_rms_norm

HIDDEN, INNER, LAYERS = 4096, 14336, 16
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN),
          "down": (HIDDEN, INNER)}  # fmt: skip


def chain(
    layers: list[dict[str, Any]], linear: Callable[..., Any], x: torch.Tensor, norm: torch.Tensor
) -> torch.Tensor:
    hidden, residual = x, None
    for w in layers:
        y, residual = add_rms_norm(hidden, residual, norm, 1e-5)
        o = linear(linear(y, w["qkv"])[:, :HIDDEN].contiguous(), w["o"])
        y, residual = add_rms_norm(o, residual, norm, 1e-5)
        hidden = linear(act_and_mul(linear(y, w["gate_up"])), w["down"])
    return hidden


def fused_chain(
    layers: list[dict[str, Any]],
    linear: Callable[..., Any],
    x: torch.Tensor,
    norm: torch.Tensor,
) -> torch.Tensor:
    """`chain` with the norms in the qkv and gate_up GEMVs."""
    hidden, residual = x, None
    for w in layers:
        row = UnnormalizedRow(hidden, residual, norm, 1e-5, False, torch.empty_like(hidden))
        o = linear(linear(row, w["qkv"])[:, :HIDDEN].contiguous(), w["o"])
        row = UnnormalizedRow(o, row.residual_out, norm, 1e-5, False, torch.empty_like(o))
        gate_up = linear(row, w["gate_up"])
        hidden = linear(act_and_mul(gate_up), w["down"])
        residual = row.residual_out
    return hidden


def random_layers(quantize: Callable[[torch.Tensor], Any], device: torch.device) -> list[Any]:
    """LAYERS layers of distinct random weights at SHAPES ({name: quantize(weight)} each), so
    that a chain over them reads its weights from HBM."""
    return [
        {name: quantize(torch.randn(n, k, device=device) * 0.02) for name, (n, k) in SHAPES.items()}
        for _ in range(LAYERS)
    ]


def layer_us(step: Callable[[], object], device: torch.device) -> float:
    """us a layer of `step`, a chain over LAYERS layers, replayed from a CUDA graph (median)."""
    return median_seconds(captured(step), device, repeats=20) / LAYERS * 1e6


def _bf16_layer(weight: torch.Tensor) -> Linear:
    n, k = weight.shape
    layer = Linear(k, n, bias=False, device=weight.device, dtype=torch.bfloat16)
    layer.weight.data.copy_(weight)
    return layer


def main() -> None:
    device = torch.device("cuda")
    copy = measure_ceilings(device, torch.bfloat16).copy_gbps * 1e9
    x = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    kinds = {
        "bf16": (_bf16_layer, lambda x, layer: layer(x), lambda n, k: 2 * n * k),
        "fp8": (quantize_rows, lambda x, w: gemv(x, *w), lambda n, k: n * k),
        "int4": (
            lambda w: quantize_rtn(w, 128, torch.bfloat16),
            packed_gemv,
            lambda n, k: n * k // 2 + 2 * 2 * n * (k // 128),
        ),
    }
    print(f"copy {copy / 1e9:.0f} GB/s; us per layer (median graph replay / {LAYERS})")
    for kind, (quantize, linear, nbytes) in kinds.items():
        layers = random_layers(quantize, device)

        def step(
            layers: list[dict[str, Any]] = layers, linear: Callable[..., Any] = linear
        ) -> torch.Tensor:
            return chain(layers, linear, x, norm)

        def fused_step(
            layers: list[dict[str, Any]] = layers,
            linear: Callable[..., Any] = linear,
        ) -> torch.Tensor:
            return fused_chain(layers, linear, x, norm)

        floor = sum(nbytes(n, k) for n, k in SHAPES.values()) / copy * 1e6
        line = f"{kind:5s} floor {floor:6.1f}"
        for on in ("0", "1"):
            os.environ[pdl.ENV_SWITCH] = on
            us = layer_us(step, device)
            line += f" | dependent={on}: {us:6.1f} ({floor / us:5.1%} of floor)"
        if kind != "int4":
            us = layer_us(fused_step, device)
            line += f" | fused: {us:6.1f} ({floor / us:5.1%} of floor)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
