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


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, acc_ptr, M, N, K, x_stride, w_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    """Split-K partial products of e4m3 rows x [M, K] and weights w [N, K], summed into the
    float32 `acc` [M, N] (scales applied after)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * w_stride + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(x, w, acc)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.atomic_add(acc_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask, sem="relaxed")


def fp8_gemv(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block_n: int = 64,
    block_k: int = 256,
    splits: int = 4,
) -> torch.Tensor:
    """x_q [M, K] e4m3 (M <= 16) times w_q [N, K] e4m3, scaled: [M, N] in `out_dtype`."""
    m, k = x_q.shape
    n = w_q.shape[0]
    assert m <= 16
    acc = torch.zeros((m, n), dtype=torch.float32, device=x_q.device)
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, per_split))
    _fp8_gemv_kernel[grid](
        x_q, w_q, acc, m, n, k, x_q.stride(0), w_q.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, K_PER_SPLIT=per_split, num_warps=4,
    )  # fmt: skip
    return (acc * x_scale * w_scale.t()).to(out_dtype)
