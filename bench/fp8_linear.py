"""FP8 W8A8 linear layers (engine/layers/quantization/fp8.py) at Llama-3-8B's shapes on the GPU:
correctness against the dequantize-then-multiply reference, then time per call against bf16
F.linear at decode and prefill token counts, split into the activation quantization (torch
ops, one pass each) and the scaled GEMM, beside the weight-streaming floors (bf16: 2 bytes per
weight, FP8: 1). Each timing runs 20 copies of the weights (no cache reuse) in a CUDA graph.

    bench/device_env.sh python3 bench/fp8_linear.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.layers.quantization.fp8 import Fp8Linear, fp8_linear_reference, quantize_rows
from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 16, 64, 256, 2048)
COPIES = 20


def replay_us(replay: Callable[[], None], copies: int, repeats: int = 15) -> float:
    """The median of `repeats` replays of a graph, in microseconds per one of its `copies`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def main() -> None:
    device = torch.device("cuda")
    copy_gbps = measure_ceilings(device, torch.bfloat16).copy_gbps
    print(f"copy {copy_gbps:.0f} GB/s")
    for name, (n, k) in SHAPES.items():
        linears = [
            torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
            for _ in range(COPIES)
        ]
        layers = [Fp8Linear.from_linear(linear) for linear in linears]
        for m in TOKENS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            q, scale = quantize_rows_triton(x)
            q_ref, scale_ref = quantize_rows(x)
            assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()
            assert torch.equal(q.float(), q_ref.float()), name
            ref = fp8_linear_reference(x, layers[0].weight, layers[0].weight_scale, None).float()
            err = (layers[0](x).float() - ref).abs().max().item() / ref.abs().max().item()
            exact = F.linear(x.float(), linears[0].weight.float())
            rel = ((layers[0](x).float() - exact).norm() / exact.norm()).item()
            bf16 = captured(lambda: [F.linear(x, w.weight) for w in linears])  # noqa: B023
            fp8 = captured(lambda: [layer(x) for layer in layers])  # noqa: B023
            quant = captured(lambda: [quantize_rows_triton(x) for _ in layers])  # noqa: B023
            times = {
                label: median_seconds(replay, device) / COPIES * 1e6
                for label, replay in (("bf16", bf16), ("fp8", fp8), ("quant", quant))
            }
            floor_bf16 = n * k * 2 / (copy_gbps * 1e9) * 1e6
            print(
                f"{name:8s} M={m:5d}: bf16 {times['bf16']:8.1f} us (floor {floor_bf16:6.1f}) | "
                f"fp8 {times['fp8']:8.1f} us (floor {floor_bf16 / 2:6.1f}, of it act-quant "
                f"{times['quant']:6.1f}) | speedup {times['bf16'] / times['fp8']:.2f}x | "
                f"vs ref {err:.1e}, vs bf16 {rel:.3f}"
            )


if __name__ == "__main__":
    main()
