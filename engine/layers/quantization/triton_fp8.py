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
from kvfleet.engine.layers.grid import cdiv, next_power_of_2, num_sms
from kvfleet.engine.layers.quantization.fp8 import _MIN_SCALE, FP8, FP8_MAX
from kvfleet.engine.layers.quantization.triton_packed import shared_workspace, split_k_store

# Inputs an e4m3 `tl.dot` sums in the tensor cores before its part is added to a float32 sum.
# Hopper's e4m3 MMAs keep fewer bits than float32 in their sums (about 14: DeepSeek-V3's report,
# section 3.3.2) and Triton lets them run over the whole of K on sm_90 unless told: at K =
# 14,336 (Llama-3-8B's down projection) sums of one sign came out 22% low and random-sign ones
# ~1% off; every SUM_SPAN inputs promoted into float32, as cuBLASLt does by default, they match
# its figures (bench/fp8_sums.py; bench/RESULTS.md "2026-11-28 (session 26)").
SUM_SPAN = 128


@triton.jit
def quantized_row(x, fp8_max, min_scale):
    """One row x [BLOCK] float32 (0 past its end) as `quantize_rows` takes it: (its values
    divided by the scale and clamped, to be stored as e4m3; the scale)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), min_scale) / fp8_max
    return scaled_to_e4m3(x, scale, fp8_max), scale


@triton.jit
def scaled_to_e4m3(x, scale, fp8_max):
    """x float32 times the reciprocal of `scale` (IEEE, as torch's `fp8.to_e4m3`), saturated:
    to be stored as e4m3."""
    return tl.clamp(x * tl.math.div_rn(1.0, scale), -fp8_max, fp8_max)


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
    values, scale = quantized_row(x, fp8_max, min_scale)
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
        block = next_power_of_2(cols)
        pdl = dependent_launch_args(x.device)
        _quantize_rows_kernel[(rows,)](
            x, out, scales, cols, x.stride(0), out.stride(0), FP8_MAX, _MIN_SCALE,
            BLOCK=block, **pdl, num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out, scales


def quantize_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_fp8.quantize_groups` in one kernel: (e4m3 values [rows, cols], scales [rows,
    cols / group] float32)."""
    rows, cols = x.shape
    values, scales = quantize_rows_triton(x.reshape(rows * cols // group, group))
    return values.reshape(rows, cols), scales.reshape(rows, cols // group)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of `fp8_gemm` for up to so many rows, and above;
# bench/fp8_gemm.py sweeps them against cuBLASLt's scaled GEMM. Up to 64 rows the weight's
# stream is all: 64-wide column tiles, 128-wide where those still give every SM a program
# (Llama-3-8B's gate_up: 32.8 against 40.7 us at 16 rows; bench/RESULTS.md "session 25").
Fp8GemmTiles = tuple[int, int, int, int, int]
FP8_GEMM_TILES: tuple[tuple[int, Fp8GemmTiles], ...] = (
    (64, (64, 64, 128, 4, 4)),
    (256, (128, 64, 128, 4, 4)),
)
FP8_GEMM_LARGE: Fp8GemmTiles = (128, 128, 128, 8, 3)


def fp8_gemm_tiles(m: int, n: int, device: torch.device) -> Fp8GemmTiles:
    """`fp8_gemm`'s tiles for an [m, K] x [n, K]^T product on `device`."""
    tiles = next((t for rows, t in FP8_GEMM_TILES if m <= rows), FP8_GEMM_LARGE)
    block_m, block_n, block_k, warps, stages = tiles
    if block_m == 64 and cdiv(n, 2 * block_n) >= num_sms(device):
        return block_m, 2 * block_n, block_k, warps, stages
    return tiles


@triton.jit
def _output_tile(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMM program's rows and columns of c [M, N], and which lie inside it."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < M, cols, cols < N


@triton.jit
def _operand_tiles(a_ptr, b_ptr, rows, row_ok, cols, col_ok, k, K, a_stride, b_stride):
    """A GEMM's tiles at inputs k: a [rows, k] and b [k, cols] of b [N, K] (0 past the ends)."""
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
    return a, b


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, partial_ptr, count_ptr, c_ptr, M, N, K,
    a_stride, b_stride, c_stride,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """c [M, N] = (a . b^T) x a's scale per row x b's per row (+ bias), a [M, K] and b [N, K]
    e4m3, both K-contiguous (the tensor cores' operands as they lie). Programs sharing a tile
    of b are consecutive, so the row tiles of a decode step read each weight tile once from
    memory and the rest from L2. SPLIT > 1: K cut into SPLIT parts (program axis 1) whose
    float32 sums the last to finish adds (`split_k_store`), where the output tiles alone are
    too few for the SMs."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    row_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % row_tiles
    pid_n = pid // row_tiles
    rows, row_ok, cols, col_ok = _output_tile(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_part = tl.cdiv(k_tiles, SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(pid_k * per_part, tl.minimum((pid_k + 1) * per_part, k_tiles)):
        k = t * BLOCK_K + ks
        a, b = _operand_tiles(a_ptr, b_ptr, rows, row_ok, cols, col_ok, k, K, a_stride, b_stride)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)  # (BLOCK_K <= SUM_SPAN)
    a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    split_k_store(acc, bias[None, :], partial_ptr, count_ptr, c_ptr,
                  rows[:, None] * c_stride + cols[None, :], row_ok[:, None] & col_ok[None, :],
                  pid, M * c_stride, pid_k, SPLIT)  # fmt: skip


def fp8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: Fp8GemmTiles | None = None,
    split: int = 1,
) -> torch.Tensor:
    """x_q [M, K] e4m3 with scales [M, 1] times w_q [N, K] e4m3 with scales [N, 1] (+ bias):
    [M, N] in `out_dtype`, as `torch._scaled_mm` gives it with row-wise scales. `tiles`:
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), else `fp8_gemm_tiles`'; `split`: parts K is
    cut into (outside CUDA graphs only: the workspace grows on first use). Either scale may be
    one value expanded (a static input scale, a per-tensor weight scale)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    x_scale = x_scale.expand(m, 1).contiguous()  # (the kernel reads a scale a row)
    w_scale = w_scale.expand(n, 1).contiguous()
    assert x_q.stride(1) == 1, "K-contiguous operands"
    assert w_q.stride(1) == 1, "K-contiguous operands"
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    if tiles is None:
        tiles = fp8_gemm_tiles(m, n, x_q.device)
    block_m, block_n, block_k, warps, stages = tiles
    assert block_k <= SUM_SPAN, "a K tile is summed in the tensor cores whole"
    grid = (cdiv(m, block_m) * cdiv(n, block_n), split)
    partials = counters = x_scale  # (unsplit: not read)
    if split > 1:
        space = shared_workspace(x_q.device, split * m * n, grid[0])
        partials, counters = space.partials, space.counters
    _fp8_gemm_kernel[grid](
        x_q, x_scale, w_q, w_scale, bias if bias is not None else w_scale, partials, counters,
        out, m, n, k, x_q.stride(0), w_q.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _block_fp8_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
    a_stride, a_scale_stride, b_stride, b_scale_stride, c_stride,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """c [M, N] float32 = sum over K tiles of (a_tile . b_tile^T) x a's scale (per row and
    tile) x b's scale (per GROUP_N rows and tile): each K tile is one scale group."""
    rows, row_ok, cols, col_ok = _output_tile(
        tl.program_id(0), tl.program_id(1), M, N, BLOCK_M, BLOCK_N
    )
    ks = tl.arange(0, GROUP_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, tl.cdiv(K, GROUP_K)):
        k = tile * GROUP_K + ks
        a, b = _operand_tiles(a_ptr, b_ptr, rows, row_ok, cols, col_ok, k, K, a_stride, b_stride)
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
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _block_fp8_matmul_kernel[grid](
        x_q, x_scale, w_q, w_scale, out, m, n, k,
        x_q.stride(0), x_scale.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
