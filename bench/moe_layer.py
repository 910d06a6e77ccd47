"""One mixture-of-experts layer at real shapes on the GPU, for decode steps of a few tokens:
the fused path's time beside the bytes its experts stream, and the router GEMV's share; at one
token, also the two-GEMV path (`triton_moe_gemv`).

    bench/device_env.sh python3 bench/moe_layer.py

Each variant is captured in a CUDA graph over COPIES copies of the layer's weights, so every
replay streams its experts from memory, not from L2; the figure is the median time per layer.
The floor: the chosen experts' weights (the distinct experts of the step's rows) at the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvfleet.bench.ceilings import captured, measure_ceilings, median_seconds
from kvfleet.engine.layers import triton_moe, triton_moe_gemv, triton_route
from kvfleet.engine.layers.moe import experts_reference, route

# (experts, top k, hidden, inner) of one layer
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
COPIES = 4
# (gate_up, down) tiles of the two-GEMV path swept beside its shipped ones (`triton_moe_gemv.
# shipped_tiles`: by the top k): (BLOCK_N, BLOCK_K, warps) each, down over all k experts a
# program (True) or split over them (False); None: the shipped choice. (Session 32 on the
# H200: over all k at (8, 256, 4) / (2, 256, 4), (2, 512, 4), (4, 512, 8), (8, 256, 8),
# (8, 128, 4) / (4, 256, 4), (4, 512, 4) / (16, 256, 8) all lost at both shapes to the best
# below; bench/RESULTS.md.)
_Tiles = tuple[tuple[int, int, int], tuple[int, int, int]]
GEMV_SWEEP: list[tuple[_Tiles | None, bool | None]] = [
    (None, None),
    (None, True),
    (None, False),
    (((8, 256, 4), (8, 256, 4)), False),  # (A3B's shipped)
    (((4, 512, 4), (4, 512, 4)), True),  # (Mixtral's shipped)
    (((4, 512, 4), (4, 512, 4)), False),  # (session 30's best at Mixtral)
    (((8, 128, 4), (4, 256, 2)), False),  # (session 30's best at A3B)
]


@dataclass
class _Layer:
    """COPIES copies of one layer's router and experts, and a step's hidden states."""

    x: torch.Tensor
    gates: list[torch.Tensor]
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    top_k: int

    def router(self, c: int) -> torch.Tensor:
        return F.linear(self.x, self.gates[c])

    def fused(self, c: int) -> torch.Tensor:
        weights, ids = triton_route.route_fused(self.router(c), self.top_k, True)
        return triton_moe.fused_experts(self.x, self.w13[c], self.w2[c], weights, ids)

    def gemvs(
        self, c: int, tiles: _Tiles | None = None, down_all: bool | None = None
    ) -> torch.Tensor:
        """One token's layer as two GEMVs (`triton_moe_gemv`), at its shipped tiles and down or
        these: down over all k experts a program or split over them."""
        return triton_moe_gemv.one_token_moe(
            self.x, self.router(c), self.w13[c], self.w2[c], self.top_k, True, tiles, down_all
        )

    def reference(self, c: int) -> torch.Tensor:
        weights, ids = route(self.router(c), self.top_k, True)
        return experts_reference(self.x, self.w13[c], self.w2[c], weights, ids)

    def distinct_experts(self) -> float:
        """Distinct experts of the step's rows, a copy on average."""
        chosen = [
            route(self.router(c), self.top_k, True)[1].unique().numel() for c in range(COPIES)
        ]
        return sum(chosen) / COPIES


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float() - reference).norm() / reference.norm())


def _layer_graph(fn: Callable[[int], object]) -> Callable[[], None]:
    """A CUDA graph of `fn(copy)` for every weight copy in turn; replaying it runs them all."""
    return captured(lambda: [fn(copy) for copy in range(COPIES)])


def main() -> None:
    device = torch.device("cuda")
    ceilings = measure_ceilings(device, torch.bfloat16)
    print(f"copy {ceilings.copy_gbps:,.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).bfloat16()

    for shape, (experts, top_k, hidden, inner) in SHAPES.items():
        gates = [randn(experts, hidden) for _ in range(COPIES)]
        w13 = [randn(experts, 2 * inner, hidden, scale=hidden**-0.5) for _ in range(COPIES)]
        w2 = [randn(experts, hidden, inner, scale=inner**-0.5) for _ in range(COPIES)]
        for tokens in (1, 2, 4):
            layer = _Layer(randn(tokens, hidden), gates, w13, w2, top_k)
            expert_bytes = layer.distinct_experts() * 3 * hidden * inner * 2
            floor_us = expert_bytes / (ceilings.copy_gbps * 1e9) * 1e6
            reference = layer.reference(0).float()
            error = _relative_error(layer.fused(0), reference)
            fused_us, router_us = (
                median_seconds(_layer_graph(fn), device, repeats=50) / COPIES * 1e6
                for fn in (layer.fused, layer.router)
            )
            print(
                f"{shape} tokens {tokens}: {fused_us:.1f} us a layer (router GEMV "
                f"{router_us:.1f} us of it); experts {expert_bytes / 1e6:.1f} MB, floor "
                f"{floor_us:.1f} us ({floor_us / fused_us:.0%}); relative error {error:.1e}"
            )
            for tiles, down_all in GEMV_SWEEP if tokens == 1 else []:
                gemvs = functools.partial(layer.gemvs, tiles=tiles, down_all=down_all)
                error = _relative_error(gemvs(0), reference)
                gemvs_us = median_seconds(_layer_graph(gemvs), device, repeats=50) / COPIES * 1e6
                down = {None: "shipped down", True: "down over all k", False: "down split"}[
                    down_all
                ]
                print(
                    f"{shape} tokens 1, two GEMVs {tiles or 'shipped'}, {down}: {gemvs_us:.1f} "
                    f"us a layer ({floor_us / gemvs_us:.0%} of floor); relative error {error:.1e}"
                )
        del gates, w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
