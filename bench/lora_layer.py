"""A step's LoRA kernels alone on the GPU: Llama-3-8B's 32 layers x 4 projections, 8 adapters of
rank 16, as a decode step of 64 tokens (one per request, the adapters round robin) and as one
prefill step of 64 prompts x 512 tokens (each prompt's tokens one adapter's), beside their floor.

    bench/device_env.sh python3 bench/lora_layer.py

Every projection has its own A and B (as each layer does), so the figure streams them from
memory. Decode: one CUDA graph of the 128 `add_lora` calls, its median replay; its floor: the
A and B of the 8 adapters plus each output read and written once, at the copy bandwidth measured
in the same run. Prefill: eager, as the engine runs a prompt step with adapters. Then the
decode step's 128 projections whole (`LoRALinear`: the base matmul and its LoRA), captured as
the engine's decode graph captures them: the base alone, the LoRA's shrink in line, the shrink on
a side stream beside the matmul, and the expand's column tile swept. Run with another tree's
`kvfleet` first on PYTHONPATH to time its kernels (the sweeps and the projections whole need
this tree's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.lora import triton_ops
from kvfleet.engine.lora.ops import LoRABatch

try:
    from kvfleet.engine.lora.layers import LoRAContext, LoRALinear

    WHOLE = hasattr(triton_ops, "EXPAND_COLUMNS")
except ImportError:
    WHOLE = False

LAYERS = 32
HIDDEN, KV, INNER = 4096, 1024, 14336
# (in, slice widths) of each wrapped projection of a Llama-3-8B layer
PROJECTIONS = {
    "qkv": (HIDDEN, (HIDDEN, KV, KV)),
    "o": (HIDDEN, (HIDDEN,)),
    "gate_up": (HIDDEN, (INNER, INNER)),
    "down": (INNER, (HIDDEN,)),
}
LORAS, RANK = 8, 16
# (SHRINK_COLUMNS, SHRINK_BLOCK_K) swept at decode, the shipped pair first
DECODE_SWEEP = [(512, 64), (256, 64), (1024, 64), (512, 128), (256, 128)]
EXPAND_SWEEP = [128, 64, 256]  # EXPAND_COLUMNS, the shipped one first


def _weights(device: torch.device) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each layer's projections' A [LORAS, slices * RANK, in] and B [LORAS, out, RANK]."""
    gen = torch.Generator(device=device).manual_seed(0)
    made = []
    for _, (name, (in_features, widths)) in itertools.product(range(LAYERS), PROJECTIONS.items()):
        shape_a = (LORAS, len(widths) * RANK, in_features)
        a = torch.randn(shape_a, generator=gen, device=device, dtype=torch.bfloat16) / 64
        b = torch.randn(LORAS, sum(widths), RANK, generator=gen, device=device).bfloat16() / 16
        made.append((name, a, b))
    return made


def _step(
    tokens: int, slots: np.ndarray, weights: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> Callable[[], None]:
    """All 128 `add_lora` calls of a step of `tokens` tokens with these slots."""
    device = weights[0][1].device
    batch = LoRABatch.build(slots, LORAS, device)
    assert batch is not None
    xs = {n: torch.randn(tokens, i, device=device).bfloat16() for n, (i, _) in PROJECTIONS.items()}
    outs = {
        n: torch.zeros(tokens, sum(w), device=device).bfloat16()
        for n, (_, w) in PROJECTIONS.items()
    }
    bounds = {n: list(itertools.accumulate(w, initial=0)) for n, (_, w) in PROJECTIONS.items()}
    starts = {n: torch.tensor(b, dtype=torch.int32, device=device) for n, b in bounds.items()}

    def step() -> None:
        for name, a, b in weights:
            triton_ops.add_lora(outs[name], xs[name], a, b, batch, bounds[name], starts[name])

    return step


def _whole_step(
    weights: list[tuple[str, torch.Tensor, torch.Tensor]], context: LoRAContext, tokens: int
) -> Callable[[], None]:
    """The decode step's 128 projections as `LoRALinear`s over random base weights."""
    device = weights[0][1].device
    gen = torch.Generator(device=device).manual_seed(1)
    layers = []
    for index, (name, a, b) in enumerate(weights):
        in_features, widths = PROJECTIONS[name]
        base = torch.nn.Linear(in_features, sum(widths), bias=False, device=device)
        base.weight.data = (
            torch.randn(sum(widths), in_features, generator=gen, device=device).bfloat16() / 64
        )
        targets = tuple(f"{name}{s}" for s in range(len(widths)))
        layer = LoRALinear(base, index // 4, targets, widths, LORAS, RANK, context)
        layer.lora_a.copy_(a)
        layer.lora_b.copy_(b)
        layers.append(layer)
    xs = {n: torch.randn(tokens, i, device=device).bfloat16() for n, (i, _) in PROJECTIONS.items()}

    @torch.inference_mode()
    def step() -> None:
        for (name, _, _), layer in zip(weights, layers, strict=True):
            layer(xs[name])

    return step


def _whole(weights: list[tuple[str, torch.Tensor, torch.Tensor]], device: torch.device) -> None:
    tokens = 64
    context = LoRAContext(use_triton=True)
    step = _whole_step(weights, context, tokens)
    batch = LoRABatch.build(np.arange(tokens) % LORAS, LORAS, device)
    runs: list[tuple[str, LoRABatch | None, bool, int]] = [
        ("base alone", None, False, EXPAND_SWEEP[0]),
        ("base + LoRA, shrink in line", batch, False, EXPAND_SWEEP[0]),
        *[
            (f"base + LoRA, shrink beside, expand columns {n}", batch, True, n)
            for n in EXPAND_SWEEP
        ],
    ]
    for label, lora, overlap, columns in runs:
        context.batch, context.overlap_shrink = lora, overlap
        triton_ops.EXPAND_COLUMNS = columns
        us = median_seconds(captured(step), device, repeats=50) * 1e6
        print(f"decode {tokens} tokens, 128 projections whole, {label}: {us:.0f} us a step")
    triton_ops.EXPAND_COLUMNS = EXPAND_SWEEP[0]


def main() -> None:
    device = torch.device("cuda")
    ceilings = measure_ceilings(device, torch.bfloat16)
    print(f"copy {ceilings.copy_gbps:,.0f} GB/s")
    weights = _weights(device)
    adapter_bytes = sum(a.numel() + b.numel() for _, a, b in weights) * 2
    out_row = sum(sum(w) for _, (_, w) in PROJECTIONS.items()) * LAYERS * 2  # bytes a token
    calls = len(weights)

    tokens = 64
    floor_us = (adapter_bytes + 2 * tokens * out_row) / (ceilings.copy_gbps * 1e3)
    decode = _step(tokens, np.arange(tokens) % LORAS, weights)
    for columns, block_k in DECODE_SWEEP:
        triton_ops.SHRINK_COLUMNS, triton_ops.SHRINK_BLOCK_K = columns, block_k
        us = median_seconds(captured(decode), device, repeats=50) * 1e6
        print(
            f"decode {tokens} tokens, {LORAS} adapters round robin, shrink columns {columns} "
            f"block_k {block_k}: {us:.0f} us a step ({us / calls:.1f} a projection), floor "
            f"{floor_us:.0f} us ({floor_us / us:.0%})"
        )
    triton_ops.SHRINK_COLUMNS, triton_ops.SHRINK_BLOCK_K = DECODE_SWEEP[0]

    prompts, prompt_len = 64, 512
    tokens = prompts * prompt_len
    floor_us = (adapter_bytes + 2 * tokens * out_row) / (ceilings.copy_gbps * 1e3)
    prefill = _step(tokens, np.repeat(np.arange(prompts) % LORAS, prompt_len), weights)
    us = median_seconds(prefill, device, repeats=5) * 1e6
    print(
        f"prefill {prompts} x {prompt_len} tokens, {LORAS} adapters: {us / 1e3:.2f} ms a step "
        f"(eager), floor {floor_us / 1e3:.2f} ms ({floor_us / us:.0%})"
    )
    if WHOLE:
        del prefill
        _whole(weights, device)


if __name__ == "__main__":
    main()
