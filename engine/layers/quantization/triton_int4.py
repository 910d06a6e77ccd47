"""A Triton W4A16 GEMM (engine/layers/quantization/int4.py's layout): the 4-bit weights are
unpacked and dequantized in registers, tile by tile, and multiplied with the activations in
their dtype; nothing dequantized is written to memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.quantization.int4 import Int4Weights


@triton.jit
def _w4a16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, group_size,
    x_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x [M, K] . W [K, N], W[k, n] = (q[k, n] - zero[k // g, n]) x
    scale[k // g, n], q packed eight to an int32 along k ([K / 8, N])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        tile_ok = k_ok[:, None] & col_ok[None, :]
        packed_at = qweight_ptr + (ks // 8)[:, None] * N + cols[None, :]
        packed = tl.load(packed_at, mask=tile_ok, other=0)
        q = (packed >> ((ks % 8) * 4)[:, None]) & 0xF
        groups = (ks // group_size)[:, None] * N + cols[None, :]
        scale = tl.load(scales_ptr + groups, mask=tile_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + groups, mask=tile_ok, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - zero) * scale).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision="ieee" if x.dtype == tl.float32 else "tf32")
    tl.store(
        out_ptr + rows[:, None] * out_stride + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, group_size,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One row: out [N] = x [K] . W. Each program takes BLOCK_N columns over all of K, loads
    each packed word once ([BLOCK_K / 8, BLOCK_N] int32, unpacked by shifts), one scale and
    zero row per tile (BLOCK_K divides the group), and accumulates elementwise into a
    [BLOCK_K, BLOCK_N] float32 tile summed once at the end."""
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    words = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        packed = tl.load(
            qweight_ptr + (k0 // 8 + words)[:, None] * N + cols[None, :],
            mask=col_ok[None, :],
            other=0,
        )
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        acc += x[:, None] * ((q.to(tl.float32) - zero[None, :]) * scale[None, :])
    out = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def w4a16_matmul(
    x: torch.Tensor,
    weights: Int4Weights,
    gemv_block_n: int = 64,
    gemv_block_k: int = 128,
    gemv_warps: int = 4,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times the 4-bit weight [K, N]: [M, N] in x's dtype. With an
    act-order permutation x's columns are gathered first."""
    if weights.perm is not None:
        x = x[:, weights.perm]
    x = x.contiguous()
    m, k = x.shape
    n = weights.qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_k = min(gemv_block_k, weights.group_size)
    if m == 1 and k % block_k == 0:  # (decode of one sequence)
        _w4a16_gemv_kernel[(triton.cdiv(n, gemv_block_n),)](
            x, weights.qweight, weights.scales, weights.zeros, out, n, k, weights.group_size,
            BLOCK_N=gemv_block_n, BLOCK_K=block_k, num_warps=gemv_warps, num_stages=3,
        )  # fmt: skip
        return out
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x, weights.qweight, weights.scales, weights.zeros, out, m, n, k, weights.group_size,
        x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out
