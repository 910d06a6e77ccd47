"""One Triton pass for a row's FP8 quantization (engine/layers/quantization/fp8.py
`quantize_rows`): the row's largest magnitude, its scale, the e4m3 values, where torch takes
five passes over the activations (abs, amax, divide, clamp, cast)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.quantization.fp8 import _MIN_SCALE, FP8, FP8_MAX


@triton.jit
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, cols, x_stride, out_stride, fp8_max, min_scale,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    let_next_start(PDL)
    wait_for_previous(PDL)
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
        pdl = dependent_launch_args(x.device)
        _quantize_rows_kernel[(rows,)](
            x, out, scales, cols, x.stride(0), out.stride(0), FP8_MAX, _MIN_SCALE,
            BLOCK=block, **pdl, num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out, scales


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, out_ptr, N, K, fp8_max, min_scale,
    STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out [N] = (the row x [K] quantized to e4m3 as `quantize_rows` does) . w [N, K]^T (e4m3),
    times both scales (+ bias): decode of one sequence in one kernel. Each program takes
    BLOCK_N output columns over the whole of K: it first finds the row's largest magnitude (x
    is small and stays in L2), then streams its weight rows once, multiplying on the CUDA cores
    into a [BLOCK_N, BLOCK_K] float32 accumulator summed once at the end (products of e4m3
    values are exact in float32). Launched dependent (PDL), it loads its first weight tile
    while the kernel before it finishes, then waits for x."""
    pid_n = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    let_next_start(PDL)
    w_first = tl.load(
        w_ptr + cols[:, None] * K + offsets[None, :],
        mask=col_ok[:, None] & (offsets < K)[None, :],
        other=0.0,
    )
    wait_for_previous(PDL)
    if STATIC:
        x_scale = tl.load(x_scale_ptr)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + offsets
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        x_scale = tl.maximum(tl.max(amax, axis=0), min_scale) / fp8_max
    acc = _fp8_products(x_ptr, offsets, K, x_scale, fp8_max, w_first, w_ptr.dtype.element_ty)
    for k in range(BLOCK_K, K, BLOCK_K):
        ks = k + offsets
        k_ok = ks < K
        w = tl.load(
            w_ptr + cols[:, None] * K + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += _fp8_products(x_ptr, ks, K, x_scale, fp8_max, w, w_ptr.dtype.element_ty)
    out = tl.sum(acc, axis=1) * x_scale * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _fp8_products(x_ptr, ks, K, x_scale, fp8_max, w, fp8: tl.constexpr):
    """[BLOCK_N, BLOCK_K] float32: the inputs x[ks] quantized to e4m3 times the weight tile w."""
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    x_q = tl.clamp(tl.math.div_rn(x, x_scale), -fp8_max, fp8_max).to(fp8).to(tl.float32)
    return x_q[None, :] * w.to(tl.float32)


def fp8_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """One row x [1, K] (bf16/fp16/fp32; quantized inside, or with the static per-tensor
    `x_scale`) times e4m3 w_q [N, K] (contiguous) with scales [N, 1]: [1, N] in x's dtype.
    Default tiles: the fastest of bench/fp8_gemv.py's sweep at Llama-3-8B's shapes (fewer,
    longer rows per program where N is small; see bench/RESULTS.md)."""
    m, k = x.shape
    n = w_q.shape[0]
    if block_n is None:
        block_n = 8 if n <= 4096 else 16
    if block_k is None:
        block_k = 1024 if n <= 4096 else 512
    assert m == 1
    assert x.is_contiguous()
    assert w_q.is_contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl = dependent_launch_args(x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w_q, w_scale, x_scale if x_scale is not None else w_scale,
        bias if bias is not None else w_scale, out, n, k, FP8_MAX, _MIN_SCALE,
        STATIC=x_scale is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, **pdl, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def quantize_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_groups` in one kernel: (e4m3 values [rows, cols], scales [rows,
    cols / group] float32)."""
    rows, cols = x.shape
    values, scales = quantize_rows_triton(x.reshape(rows * cols // group, group))
    return values.reshape(rows, cols), scales.reshape(rows, cols // group)


@triton.jit
def _block_fp8_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
    a_stride, a_scale_stride, b_stride, b_scale_stride, c_stride,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """c [M, N] float32 = sum over K tiles of (a_tile . b_tile^T) x a's scale (per row and
    tile) x b's scale (per GROUP_N rows and tile): each K tile is one scale group."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, GROUP_K)):
        k = tile * GROUP_K + ks
        a = tl.load(
            a_ptr + rows[:, None] * a_stride + k[None, :],
            mask=row_ok[:, None] & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + cols[None, :] * b_stride + k[:, None],
            mask=col_ok[None, :] & (k[:, None] < K),
            other=0.0,
        )
        a_scale = tl.load(a_scale_ptr + rows * a_scale_stride + tile, mask=row_ok, other=0.0)
        b_scale = tl.load(
            b_scale_ptr + (cols // GROUP_N) * b_scale_stride + tile, mask=col_ok, other=0.0
        )
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    tl.store(
        c_ptr + rows[:, None] * c_stride + cols[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


def block_fp8_matmul(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """x_q [M, K] e4m3 with scales [M, K / block[1]] times w_q [N, K] e4m3 with scales
    [N / block[0], K / block[1]]: [M, N] float32."""
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x_q.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 64 if m <= 16 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_matmul_kernel[grid](
        x_q, x_scale, w_q, w_scale, out, m, n, k,
        x_q.stride(0), x_scale.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
