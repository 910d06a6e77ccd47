"""One Triton pass for a row's FP8 quantization (engine/layers/quantization/fp8.py
`quantize_rows`): the row's largest magnitude, its scale, the e4m3 values, where torch takes
five passes over the activations (abs, amax, divide, clamp, cast)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.quantization.fp8 import _MIN_SCALE, FP8, FP8_MAX


@triton.jit
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, cols, x_stride, out_stride, fp8_max, min_scale,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(x_ptr + row * x_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_scale) / fp8_max
    values = tl.clamp(tl.math.div_rn(x, scale), -fp8_max, fp8_max)  # (IEEE, as torch)
    tl.store(out_ptr + row * out_stride + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in one kernel: (e4m3 values [rows, cols], scales [rows, 1] float32)."""
    assert x.dim() == 2
    assert x.stride(-1) == 1
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _quantize_rows_kernel[(rows,)](
            x, out, scales, cols, x.stride(0), out.stride(0), FP8_MAX, _MIN_SCALE,
            BLOCK=block, num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out, scales
