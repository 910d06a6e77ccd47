"""What a one-row GEMV reads as its row (`triton_gemv`'s kernels, `triton_moe_gemv`'s): the
row as given, made from what the kernel before would have made (`UnnormalizedRow`: the
residual add + RMSNorm), or merged from decode attention's splits left unmerged (`SplitRows`);
the row's e4m3 scale and inverse RMS found before the products; a weight tile (the splits'
merge: `triton_merge.merged_values`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.linear import UnnormalizedRow
from kvfleet.engine.layers.triton_layers import inverse_rms, rms_scaled, summed_row


def row_and_norm(
    x: torch.Tensor | UnnormalizedRow,
) -> tuple[torch.Tensor, UnnormalizedRow | None]:
    """(the row a GEMV reads, the norm it applies to it or None)."""
    if isinstance(x, UnnormalizedRow):
        return x.x, x
    return x, None


def norm_args(
    norm: UnnormalizedRow | None, row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(residual, the norm's weight, residual out) for a GEMV kernel (the row in their place
    where there is no norm or no residual: never read)."""
    if norm is None:
        return row, row, row
    residual = norm.residual if norm.residual is not None else row
    return residual, norm.weight, norm.residual_out


@triton.jit
def weight_tile(w_ptr, cols, col_ok, ks, K):
    """The weight's [BLOCK_N, BLOCK_K] tile at rows `cols`, inputs `ks` (0 past either end)."""
    return tl.load(
        w_ptr + cols[:, None] * K + ks[None, :],
        mask=col_ok[:, None] & (ks < K)[None, :],
        other=0.0,
    )


@triton.jit
def row_values(x_ptr, ks, K, residual_ptr, norm_w_ptr, inv_rms, NORM: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr):  # fmt: skip
    """The multiplied row's inputs `ks` (0 past K): x[ks], or when NORM RMSNorm(x +
    residual)[ks] of the row whose `inverse_rms` is inv_rms."""
    ok = ks < K
    if NORM:
        weight = tl.load(norm_w_ptr + ks, mask=ok, other=0.0)
        x = rms_scaled(summed_row(x_ptr, residual_ptr, ks, ok, HAS_RESIDUAL), weight, inv_rms,
                       OFFSET)  # fmt: skip
    else:
        x = tl.load(x_ptr + ks, mask=ok, other=0.0)
    return x


@triton.jit
def whole_row(x_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, x_scale_ptr, first, K,
               fp8_max, min_scale, eps, ROW_BLOCK: tl.constexpr, DYNAMIC: tl.constexpr,
               STATIC: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               OFFSET: tl.constexpr):  # fmt: skip
    """(x_scale, inv_rms) of the multiplied row: its e4m3 scale (DYNAMIC: its largest magnitude
    over fp8_max, as `quantize_rows`; STATIC: the checkpoint's; else 1) and, when NORM, the
    `inverse_rms` of x + residual, which the `first` program writes out. The whole row in one
    load (from L2: a loop over it, each load waiting for the last, held the weights' stream
    back by a round trip per tile)."""
    x_scale = 1.0
    inv_rms = 1.0
    if STATIC:
        x_scale = tl.load(x_scale_ptr)
    if NORM or DYNAMIC:
        row = tl.arange(0, ROW_BLOCK)
        ok = row < K
        if NORM:
            summed = summed_row(x_ptr, residual_ptr, row, ok, HAS_RESIDUAL)
            inv_rms = inverse_rms(summed, K, eps)
            if first:
                tl.store(residual_out_ptr + row, summed, mask=ok)
            if DYNAMIC:
                weight = tl.load(norm_w_ptr + row, mask=ok, other=0.0)
                x = rms_scaled(summed, weight, inv_rms, OFFSET)
                amax = tl.max(tl.abs(x), axis=0).to(tl.float32)  # (exact in x's dtype)
                x_scale = tl.maximum(amax, min_scale) / fp8_max
        else:
            x = tl.load(x_ptr + row, mask=ok, other=0.0)
            amax = tl.max(tl.abs(x), axis=0).to(tl.float32)
            x_scale = tl.maximum(amax, min_scale) / fp8_max
    return x_scale, inv_rms
