"""The one-row 4-bit GEMV of large layers with whole columns to a thread (bf16 activations;
`triton_packed.packed_gemv` hands them here).

`triton_packed._packed_gemv_kernel`'s tile [16 word rows, 32 columns] gives each thread 2 word
rows x 4 columns: every thread loads, widens and scales 16 inputs for 64 weights and applies
the group's scale and zero to every word: 5.3 SASS instructions a weight (sm_90), issue-bound
at ~73% of the H200's byte floor before any latency. Here a program takes BLOCK_N columns (8 a
thread at 256 on one warp) over ROWS word rows, in chunks: a thread's 8 inputs of a word row
serve 64 weights, the products chain into one float32 sum a column, and the scale and zero
apply once a group (~3.5 instructions a weight). The next chunk's words, inputs and scales
load while a chunk is used; the first chunk's words before the wait (dependent launch).
Two forms, each faster at one shape (bench/int4_rows.py, H200, Llama-3-8B):
- `_packed_gemv_rows_kernel`: chunks of 4 rows as 4 named [BLOCK_N] vectors; gate_up
  (28,672 x 4,096) at (256, 32, 2 warps) 22.9 us against 27.8;
- `_packed_gemv_tile_kernel`: chunks of CHUNK rows as one [CHUNK, BLOCK_N] tile (all rows of
  a column in one thread: BLOCK_N at least 128 x warps); down (4,096 x 14,336) at (256, 32, 1
  warp, 8-row chunks) 15.0 us against 16.6.
Smaller layers (qkv, o) stay with the shipped kernel: their many more, shorter programs hide
latency better (9.2 against 9.0-13.5 us at qkv, 7.2 against 9.8+ at o).
Values are read as subnormals as there (`triton_packed`'s SUBNORMAL_SHIFT): bit-for-bit the
same sums in another order.
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
    _AT_BIT_0,
    _AT_BIT_4,
    _AT_BIT_8,
    _AT_BIT_12,
    _AT_BIT_16,
    _SCALE_BACK,
    _add_products,
    shared_workspace,
    split_k_store,
)


@triton.jit
def _row_words(qweight_ptr, word_row, cols, col_ok, N, K, EVEN: tl.constexpr):
    """Word row `word_row` of columns `cols` [BLOCK_N] (0 past K or N)."""
    if EVEN:
        return tl.load(qweight_ptr + word_row * N + cols)
    return tl.load(
        qweight_ptr + word_row * N + cols, mask=tl.where(word_row * 8 < K, col_ok, False), other=0
    )


@triton.jit
def _x_pairs(x_ptr, k):
    """x[k .. k + 7] (bfloat16) as four 32-bit words of two."""
    pairs = (x_ptr + k).to(tl.pointer_type(tl.int32), bitcast=True)
    return tl.load(pairs), tl.load(pairs + 1), tl.load(pairs + 2), tl.load(pairs + 3)


@triton.jit
def _low(pair):
    return (pair << 16).to(tl.float32, bitcast=True)


@triton.jit
def _high(pair):
    return (pair & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _inputs(p01, p23, p45, p67):
    """x_0..7 as float32 from their bf16 pairs."""
    return (
        _low(p01),
        _high(p01),
        _low(p23),
        _high(p23),
        _low(p45),
        _high(p45),
        _low(p67),
        _high(p67),
    )


@triton.jit
def _row_products(acc, x_sum, packed, p01, p23, p45, p67):
    """(acc + sum_j x_j q_j 2^-64 over each word's eight values, x_sum + sum_j x_j) for one
    word row `packed` [BLOCK_N] and its inputs x_0..7 as bf16 pairs."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _inputs(p01, p23, p45, p67)
    acc = _add_products(acc, packed, x0 * _AT_BIT_0, x1 * _AT_BIT_4, x2 * _AT_BIT_8,
                        x3 * _AT_BIT_12, x4 * _AT_BIT_16, x5 * _AT_BIT_0, x6 * _AT_BIT_4,
                        x7 * _AT_BIT_8)  # fmt: skip
    return acc, x_sum + (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))


@triton.jit
def _chunk(qweight_ptr, row, cols, col_ok, N, K, EVEN: tl.constexpr):
    """Word rows row .. row + 3 of columns `cols` [BLOCK_N] each (0 past K or N)."""
    w0 = _row_words(qweight_ptr, row, cols, col_ok, N, K, EVEN)
    w1 = _row_words(qweight_ptr, row + 1, cols, col_ok, N, K, EVEN)
    w2 = _row_words(qweight_ptr, row + 2, cols, col_ok, N, K, EVEN)
    w3 = _row_words(qweight_ptr, row + 3, cols, col_ok, N, K, EVEN)
    return w0, w1, w2, w3


@triton.jit
def _chunk_x(x_ptr, row, K):
    """The 32 inputs of word rows row .. row + 3 as 16 bf16 pairs (a chunk past K: the last
    32 inputs, in bounds, finite: its words are 0)."""
    k = tl.minimum(row * 8, K - 32)
    a0, a1, a2, a3 = _x_pairs(x_ptr, k)
    b0, b1, b2, b3 = _x_pairs(x_ptr, k + 8)
    c0, c1, c2, c3 = _x_pairs(x_ptr, k + 16)
    d0, d1, d2, d3 = _x_pairs(x_ptr, k + 24)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _chunk_products(acc, w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0,
                    d1, d2, d3):  # fmt: skip
    """(acc + a 4-row chunk's products, the sum of its 32 inputs)."""
    sums = 0.0
    acc, sums = _row_products(acc, sums, w0, a0, a1, a2, a3)
    acc, sums = _row_products(acc, sums, w1, b0, b1, b2, b3)
    acc, sums = _row_products(acc, sums, w2, c0, c1, c2, c3)
    acc, sums = _row_products(acc, sums, w3, d0, d1, d2, d3)
    return acc, sums


@triton.jit
def _program(N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """(pid_n, pid_k, its columns [BLOCK_N], which are below N, its first word row)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_n, pid_k, cols, cols < N, pid_k * ROWS


@triton.jit
def _store(acc, bias_ptr, partial_ptr, count_ptr, out_ptr, cols, col_ok, pid_n, pid_k, N,
           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The program's part `acc` [BLOCK_N] (+ the bias) into out by `split_k_store`."""
    bias = tl.zeros_like(acc)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    split_k_store(acc, bias, partial_ptr, count_ptr, out_ptr, cols, col_ok, pid_n, N, pid_k, SPLIT)


@triton.jit
def _group_scale(scales_ptr, zeros_ptr, row, cols, col_ok, N, K, GROUP: tl.constexpr,
                 EVEN: tl.constexpr):  # fmt: skip
    """The scale and zero [BLOCK_N] (float32) of the group holding word row `row`."""
    at = tl.minimum(row * 8 // GROUP, K // GROUP - 1) * N + cols
    if EVEN:
        return tl.load(scales_ptr + at).to(tl.float32), tl.load(zeros_ptr + at).to(tl.float32)
    scale = tl.load(scales_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
    return scale, tl.load(zeros_ptr + at, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _packed_gemv_rows_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, partial_ptr, count_ptr, out_ptr,
    N, K,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    GROUP: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out [N] = x [K] (bf16) . W (+ bias), W of 4-bit values in groups of GROUP inputs.
    Program (n, s) takes BLOCK_N columns over word rows s ROWS .. in chunks of 4 rows (32
    inputs), the next chunk's words, inputs, scale and zero loaded while this one's are used;
    the first chunk's words load before the wait (dependent launch). NOTE: GROUP is a multiple
    of 32 and ROWS of 4 (`rows_plan`)."""
    pid_n, pid_k, cols, col_ok, row0 = _program(N, BLOCK_N, ROWS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    group_xq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    group_x = 0.0
    let_next_start(PDL)
    w0, w1, w2, w3 = _chunk(qweight_ptr, row0, cols, col_ok, N, K, EVEN)
    wait_for_previous(PDL)
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _chunk_x(x_ptr, row0, K)
    scale, zero = _group_scale(scales_ptr, zeros_ptr, row0, cols, col_ok, N, K, GROUP, EVEN)
    for chunk in range(ROWS // 4):
        row = row0 + chunk * 4
        # the next chunk (the last chunk again at the end: in bounds, unused), its inputs and
        # its group's scale and zero, loaded while this chunk is used
        following = row0 + tl.minimum(chunk + 1, ROWS // 4 - 1) * 4
        u0, u1, u2, u3 = _chunk(qweight_ptr, following, cols, col_ok, N, K, EVEN)
        e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3 = _chunk_x(
            x_ptr, following, K
        )
        next_scale, next_zero = _group_scale(scales_ptr, zeros_ptr, following, cols, col_ok, N,
                                             K, GROUP, EVEN)  # fmt: skip
        group_xq, sums = _chunk_products(group_xq, w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2,
                                         b3, c0, c1, c2, c3, d0, d1, d2, d3)  # fmt: skip
        group_x += tl.where(row * 8 < K, sums, 0.0)
        if ((chunk + 1) * 32) % GROUP == 0 or chunk == ROWS // 4 - 1:
            acc += group_xq * (scale * _SCALE_BACK) - group_x * (zero * scale)
            group_xq = tl.zeros((BLOCK_N,), dtype=tl.float32)
            group_x = 0.0
        w0, w1, w2, w3 = u0, u1, u2, u3
        a0, a1, a2, a3 = e0, e1, e2, e3
        b0, b1, b2, b3 = f0, f1, f2, f3
        c0, c1, c2, c3 = g0, g1, g2, g3
        d0, d1, d2, d3 = h0, h1, h2, h3
        scale, zero = next_scale, next_zero
    _store(acc, bias_ptr, partial_ptr, count_ptr, out_ptr, cols, col_ok, pid_n, pid_k, N,
           HAS_BIAS, SPLIT)  # fmt: skip


@triton.jit
def _tile_x(x_ptr, rows, K):
    """The inputs of word rows `rows` [CHUNK] (clamped in bounds) as four [CHUNK] tensors of
    bf16 pairs."""
    pairs = (x_ptr + tl.minimum(rows * 8, K - 8)).to(tl.pointer_type(tl.int32), bitcast=True)
    return tl.load(pairs), tl.load(pairs + 1), tl.load(pairs + 2), tl.load(pairs + 3)


@triton.jit
def _tile_words(qweight_ptr, rows, cols, col_ok, N, K, EVEN: tl.constexpr):
    """Words [CHUNK, BLOCK_N] of word rows `rows`, 0 past K or N."""
    at = rows[:, None] * N + cols[None, :]
    if EVEN:
        return tl.load(qweight_ptr + at)
    return tl.load(qweight_ptr + at, mask=(rows * 8 < K)[:, None] & col_ok[None, :], other=0)


@triton.jit
def _packed_gemv_tile_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, partial_ptr, count_ptr, out_ptr,
    N, K,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`_packed_gemv_rows_kernel` with chunks of CHUNK rows as [CHUNK, BLOCK_N] tiles (a
    thread holds all CHUNK rows of its columns: BLOCK_N at least 128 x warps)."""
    pid_n, pid_k, cols, col_ok, row0 = _program(N, BLOCK_N, ROWS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    group_xq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    group_x = 0.0
    within = tl.arange(0, CHUNK)
    let_next_start(PDL)
    words = _tile_words(qweight_ptr, row0 + within, cols, col_ok, N, K, EVEN)
    wait_for_previous(PDL)
    p01, p23, p45, p67 = _tile_x(x_ptr, row0 + within, K)
    scale, zero = _group_scale(scales_ptr, zeros_ptr, row0, cols, col_ok, N, K, GROUP, EVEN)
    for chunk in range(ROWS // CHUNK):
        rows = row0 + chunk * CHUNK + within
        following = row0 + tl.minimum(chunk + 1, ROWS // CHUNK - 1) * CHUNK
        loaded = _tile_words(qweight_ptr, following + within, cols, col_ok, N, K, EVEN)
        n01, n23, n45, n67 = _tile_x(x_ptr, following + within, K)
        next_scale, next_zero = _group_scale(scales_ptr, zeros_ptr, following, cols, col_ok, N,
                                             K, GROUP, EVEN)  # fmt: skip
        x0, x1, x2, x3, x4, x5, x6, x7 = _inputs(p01, p23, p45, p67)
        xq = _add_products(
            tl.zeros((CHUNK, BLOCK_N), dtype=tl.float32), words, (x0 * _AT_BIT_0)[:, None],
            (x1 * _AT_BIT_4)[:, None], (x2 * _AT_BIT_8)[:, None], (x3 * _AT_BIT_12)[:, None],
            (x4 * _AT_BIT_16)[:, None], (x5 * _AT_BIT_0)[:, None], (x6 * _AT_BIT_4)[:, None],
            (x7 * _AT_BIT_8)[:, None],
        )  # fmt: skip
        group_xq += tl.sum(xq, axis=0)
        sums = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        group_x += tl.sum(tl.where(rows * 8 < K, sums, 0.0), axis=0)
        if ((chunk + 1) * CHUNK * 8) % GROUP == 0 or chunk == ROWS // CHUNK - 1:
            acc += group_xq * (scale * _SCALE_BACK) - group_x * (zero * scale)
            group_xq = tl.zeros((BLOCK_N,), dtype=tl.float32)
            group_x = 0.0
        words = loaded
        p01, p23, p45, p67 = n01, n23, n45, n67
        scale, zero = next_scale, next_zero
    _store(acc, bias_ptr, partial_ptr, count_ptr, out_ptr, cols, col_ok, pid_n, pid_k, N,
           HAS_BIAS, SPLIT)  # fmt: skip


# (BLOCK_N, ROWS, warps[, CHUNK]) by shape: wide layers (N >= K, gate_up) as named 4-row chunks,
# long ones (K > N, down) as 8-row tiles; from this many weights (triton_packed's large layers)
WIDE_TILES = (256, 32, 2)
LONG_TILES = (256, 32, 1, 8)
ROWS_FROM_WEIGHTS = 1 << 25


def rows_plan(n: int, k: int, group_size: int, tiles: tuple[int, ...]) -> tuple[int, bool] | None:
    """(SPLIT, EVEN) for N outputs of K inputs at `tiles` (BLOCK_N, ROWS, warps[, CHUNK]),
    or None where the kernels cannot take the layer (K or the group not a multiple
    of a chunk's inputs, ROWS not of whole chunks, or groups and programs that do not nest)."""
    block_n, rows, _, *more = tiles
    step = 8 * (more[0] if more and more[0] else 4)
    inputs = rows * 8
    if (
        k % step
        or group_size % step
        or inputs % step
        or (group_size % inputs and inputs % group_size)
    ):
        return None
    word_rows = k // 8
    return cdiv(word_rows, rows), n % block_n == 0 and word_rows % rows == 0


def rows_tiles(n: int, k: int, group_size: int) -> tuple[int, ...] | None:
    """The tiles a layer of N outputs and K inputs takes here, or None (the shipped kernel)."""
    if n * k < ROWS_FROM_WEIGHTS:
        return None
    tiles = LONG_TILES if k > n else WIDE_TILES
    return tiles if rows_plan(n, k, group_size, tiles) is not None else None


def packed_gemv_rows(
    x: torch.Tensor, weights: PackedWeights, bias: torch.Tensor | None,
    tiles: tuple[int, ...],
) -> torch.Tensor:  # fmt: skip
    """One bf16 row x [1, K] times 4-bit `weights` (no act-order) (+ bias): [1, N] in bf16;
    `tiles` (BLOCK_N, ROWS, warps[, CHUNK]), which `rows_plan` takes: CHUNK rows a tile in the
    tile form (0 or none: named 4-row chunks)."""
    assert weights.bits == 4
    assert weights.perm is None
    assert x.dtype == torch.bfloat16
    block_n, rows, warps, *more = tiles
    chunk = more[0] if more else 0  # (0: the named 4-row chunks)
    k = x.shape[1]
    n = weights.qweight.shape[1]
    plan = rows_plan(n, k, weights.group_size, tiles)
    assert plan is not None
    split, even = plan
    tiles_n = cdiv(n, block_n)
    space = shared_workspace(x.device, split * n, tiles_n)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    kernel, extra = _packed_gemv_rows_kernel, {}
    if chunk:
        kernel, extra = _packed_gemv_tile_kernel, {"CHUNK": chunk}
    # (num_stages 1: the chunks are loaded ahead by hand; Triton's pipelining would stage them
    # through shared memory)
    kernel[(tiles_n, split)](
        x.contiguous(), weights.qweight, weights.scales, weights.zeros,
        bias if bias is not None else weights.scales, space.partials, space.counters, out, n, k,
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_N=block_n, ROWS=rows,
        GROUP=weights.group_size, EVEN=even, **dependent_launch_args(x.device), num_warps=warps,
        num_stages=1, **extra,
    )  # fmt: skip
    return out
