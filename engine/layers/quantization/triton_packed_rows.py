"""The one-row 4-bit GEMV with whole columns to a thread (a candidate for
`triton_packed._packed_gemv_kernel`, timed beside it by bench/int4_rows.py).

The shipped kernel's tile [16 word rows, 32 columns] gives each thread 2 word rows x 4
columns: every thread loads, widens and scales 16 inputs for 64 weights, and applies the
group's scale and zero to every word (5.3 SASS instructions a weight on sm_90, issue-bound
at ~73% of the H200's byte floor before any latency). Here a program walks ROWS word rows one
at a time, each a [BLOCK_N] vector (8 columns a thread), so a thread's 8 inputs of a row serve
64 weights, the products chain into one float32 sum a column, and the scale and zero apply
once a group (3.45 instructions a weight, offline sm_90 compile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import cdiv
from kvfleet.engine.layers.quantization.packed import PackedWeights
from kvfleet.engine.layers.quantization.triton_packed import (
    _SCALE_BACK,
    shared_workspace,
    split_k_store,
)

# x's factor for value j of a word: 2^(149 - 64 - 4 j) (triton_packed's subnormal products)
_AT_0 = tl.constexpr(2.0**85)
_AT_4 = tl.constexpr(2.0**81)
_AT_8 = tl.constexpr(2.0**77)
_AT_12 = tl.constexpr(2.0**73)
_AT_16 = tl.constexpr(2.0**69)


@triton.jit
def _row_words(qweight_ptr, word_row, cols, col_ok, N, K, EVEN: tl.constexpr):
    """Word row `word_row` of columns `cols` [BLOCK_N] (0 past K or N)."""
    if EVEN:
        return tl.load(qweight_ptr + word_row * N + cols)
    return tl.load(qweight_ptr + word_row * N + cols, mask=tl.where(word_row * 8 < K, col_ok, False), other=0)


@triton.jit
def _bf16_pair(x_ptr, k):
    """x[k], x[k + 1] (bfloat16) as float32 from one 32-bit load."""
    pair = tl.load((x_ptr + k).to(tl.pointer_type(tl.int32), bitcast=True))
    return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _row_products(acc, packed, x_ptr, k, ok):
    """(acc + sum_j x[k + j] q_j 2^-64 over each word's eight values, sum_j x[k + j]); a row
    past K (`ok` false: its words are 0) reads x[0..7] and adds nothing."""
    k = tl.where(ok, k, 0)
    x0, x1 = _bf16_pair(x_ptr, k)
    x2, x3 = _bf16_pair(x_ptr, k + 2)
    x4, x5 = _bf16_pair(x_ptr, k + 4)
    x6, x7 = _bf16_pair(x_ptr, k + 6)
    high = packed >> 20
    acc += (x0 * _AT_0) * (packed & 0xF).to(tl.float32, bitcast=True)
    acc += (x1 * _AT_4) * (packed & 0xF0).to(tl.float32, bitcast=True)
    acc += (x2 * _AT_8) * (packed & 0xF00).to(tl.float32, bitcast=True)
    acc += (x3 * _AT_12) * (packed & 0xF000).to(tl.float32, bitcast=True)
    acc += (x4 * _AT_16) * (packed & 0xF0000).to(tl.float32, bitcast=True)
    acc += (x5 * _AT_0) * (high & 0xF).to(tl.float32, bitcast=True)
    acc += (x6 * _AT_4) * (high & 0xF0).to(tl.float32, bitcast=True)
    acc += (x7 * _AT_8) * (high & 0xF00).to(tl.float32, bitcast=True)
    x_sum = tl.where(ok, ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), 0.0)
    return acc, x_sum


@triton.jit
def _packed_gemv_rows_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, partial_ptr, count_ptr, out_ptr,
    N, K,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    AHEAD: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out [N] = x [K] (bf16) . W (+ bias), W of 4-bit values in groups of GROUP inputs.
    Program (n, s) takes BLOCK_N columns over word rows s ROWS ..; its first AHEAD rows load
    before the wait (dependent launch). NOTE: ROWS x 8 divides GROUP or GROUP divides it, so
    a program's groups start where its flushes do."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    group_xq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    group_x = 0.0
    row0 = pid_k * ROWS
    let_next_start(PDL)
    # (AHEAD of 1 to 4: the rows loaded before the wait, named; Triton has no lists)
    w0 = _row_words(qweight_ptr, row0, cols, col_ok, N, K, EVEN)
    w1 = w0
    w2 = w0
    w3 = w0
    if AHEAD > 1:
        w1 = _row_words(qweight_ptr, row0 + 1, cols, col_ok, N, K, EVEN)
    if AHEAD > 2:
        w2 = _row_words(qweight_ptr, row0 + 2, cols, col_ok, N, K, EVEN)
    if AHEAD > 3:
        w3 = _row_words(qweight_ptr, row0 + 3, cols, col_ok, N, K, EVEN)
    wait_for_previous(PDL)
    for r in tl.static_range(ROWS):
        if r >= AHEAD:
            packed = _row_words(qweight_ptr, row0 + r, cols, col_ok, N, K, EVEN)
        elif r == 0:
            packed = w0
        elif r == 1:
            packed = w1
        elif r == 2:
            packed = w2
        else:
            packed = w3
        k = (row0 + r) * 8
        group_xq, x_sum = _row_products(group_xq, packed, x_ptr, k, k < K)
        group_x += x_sum
        if (r + 1) % (GROUP // 8) == 0 or r == ROWS - 1:
            at = tl.minimum(k // GROUP, K // GROUP - 1) * N + cols
            if EVEN:
                scale = tl.load(scales_ptr + at).to(tl.float32)
                zero = tl.load(zeros_ptr + at).to(tl.float32)
            else:
                scale = tl.load(scales_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
            acc += group_xq * (scale * _SCALE_BACK) - group_x * (zero * scale)
            group_xq = tl.zeros((BLOCK_N,), dtype=tl.float32)
            group_x = 0.0
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    split_k_store(acc, bias, partial_ptr, count_ptr, out_ptr, cols, col_ok, pid_n, N, pid_k, SPLIT)


def rows_plan(n: int, k: int, group_size: int, block_n: int, rows: int) -> tuple[int, int, bool]:
    """(rows a program, SPLIT, EVEN) for N outputs of K inputs at BLOCK_N columns a program."""
    word_rows = k // 8
    inputs = rows * 8
    if group_size % inputs and inputs % group_size:
        raise ValueError(f"{inputs} inputs a program and groups of {group_size} do not nest")
    split = cdiv(word_rows, rows)
    return rows, split, n % block_n == 0 and word_rows % rows == 0


def packed_gemv_rows(
    x: torch.Tensor, weights: PackedWeights, bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] = (256, 16, 4, 1),
) -> torch.Tensor:  # fmt: skip
    """One bf16 row x [1, K] times 4-bit `weights` (no act-order) (+ bias): [1, N];
    `tiles` (BLOCK_N, ROWS, AHEAD, warps)."""
    assert weights.bits == 4 and weights.perm is None and x.dtype == torch.bfloat16
    block_n, rows, ahead, warps = tiles
    k = x.shape[1]
    n = weights.qweight.shape[1]
    rows, split, even = rows_plan(n, k, weights.group_size, block_n, rows)
    tiles_n = cdiv(n, block_n)
    space = shared_workspace(x.device, split * n, tiles_n)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _packed_gemv_rows_kernel[(tiles_n, split)](
        x.contiguous(), weights.qweight, weights.scales, weights.zeros,
        bias if bias is not None else weights.scales, space.partials, space.counters, out, n, k,
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_N=block_n, ROWS=rows, AHEAD=ahead,
        GROUP=weights.group_size, EVEN=even, **dependent_launch_args(x.device), num_warps=warps,
    )  # fmt: skip
    return out
