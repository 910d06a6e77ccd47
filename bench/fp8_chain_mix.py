"""The batch-1 FP8 layer chain (bench/gemv_chain.py's, norms in the GEMVs, launched dependent)
with one layer at a time taken by the CUDA-core e4m3 GEMV (`triton_gemv._gemv_kernel`, many
small programs, as bf16's GEMV whose gate_up streams at its floor on the critical path) instead
of the tensor-core GEMV (`fp8_gemv_mma`, 64-row programs): us a layer against the chain with
every layer on the tensor cores, alternating in the same run.

    bench/device_env.sh python3 bench/fp8_chain_mix.py
"""

from __future__ import annotations

from typing import Any

import torch

from kvfleet.bench.ceilings import measure_ceilings
from kvfleet.bench.gemv_chain import HIDDEN, LAYERS, SHAPES, fused_chain, layer_us, random_layers
from kvfleet.engine.layers.quantization.fp8 import quantize_rows
from kvfleet.engine.layers.triton_gemv import gemv

# (BLOCK_N, BLOCK_K, warps, stages) of the CUDA-core kernel tried at each layer
TILES = [(16, 512, 4, 3), (16, 1024, 4, 3), (8, 1024, 4, 3), (32, 512, 8, 3), (16, 512, 8, 4),
         (8, 512, 4, 3), (4, 1024, 4, 4)]  # fmt: skip


def main() -> None:
    device = torch.device("cuda")
    copy = measure_ceilings(device, torch.bfloat16).copy_gbps * 1e9
    x = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    layers = random_layers(quantize_rows, device)
    floor = sum(n * k for n, k in SHAPES.values()) / copy * 1e6
    by_shape: dict[tuple[int, ...], str] = {shape: name for name, shape in SHAPES.items()}

    def timed(choice: dict[str, Any]) -> tuple[float, torch.Tensor]:
        def linear(x: Any, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return gemv(x, *w, tiles=choice.get(by_shape[tuple(w[0].shape)]))

        def step() -> torch.Tensor:
            return fused_chain(layers, linear, x, norm)

        return layer_us(step, device), step().float()

    print(f"copy {copy / 1e9:.0f} GB/s; floor {floor:.1f} us a layer (median replay / {LAYERS})")
    base_us, base_out = timed({})
    print(
        f"all on the tensor cores: {base_us:6.1f} us a layer ({floor / base_us:5.1%})", flush=True
    )
    for name in SHAPES:
        for tiles in TILES:
            us, out = timed({name: tiles})
            again, _ = timed({})
            err = ((out - base_out).norm() / base_out.norm()).item()
            print(f"{name:8s} CUDA-core {tiles}: {us:6.1f} us a layer, all tensor cores "
                  f"{again:6.1f} (output {err:.0e} from it)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
