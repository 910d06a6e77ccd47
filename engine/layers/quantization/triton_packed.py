"""Triton W4A16 / W8A16 kernels over engine/layers/quantization/packed.py's layout (qweight
[K / P, N], P = 8 four-bit or 4 eight-bit values to a word; described below for 4 bits).

- `_packed_gemv_kernel`, one row (decode of one sequence): split-K. Program (n, s) takes
  BLOCK_N output columns over STEPS x BLOCK_K inputs; the SPLIT programs of a column block each
  write a float32 partial and count themselves in; the last to arrive adds the partials in a
  fixed order (the result does not depend on which program finishes last), adds the bias,
  writes the output and resets the counter for the next call. No extra launch, no atomics on
  the data.
  Unpacking costs one logic operation per value: value j of a word, masked where it sits
  (bits 4 j), read as a float32 is the subnormal q 2^(4 j - 149), exactly; the activation it
  meets is pre-multiplied by 2^(149 - 4 j - 64) (exact: a power of two), so one FMA adds
  x q 2^-64 with the rounding of x q itself (the PTX has no .ftz: subnormals are kept, at full
  rate). Values 5-7 come from the word shifted right by 20 (the subnormals take bits 0-22). The
  scale, times 2^64, and the zero apply once per word row: sum_k x w = s (sum_k x q) - s zero
  (sum_k x).
- `_packed_gemm_kernel`, a few rows (batched decode): per step R rows of words (8 R inputs) as
  eight `tl.dot`s of K = R, slice j pairing value j of each word with inputs 8 w + j. The
  activations are regrouped once per call so that each slice is contiguous ([M, 8, K / 8]:
  a strided gather inside the kernel made it 3x slower).
- `_dequantize_kernel`: the weight in the activations' dtype, for many rows (prompts: there the
  GEMM is compute-bound and the dequantizing pass a small part), multiplied by cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import cdiv
from kvfleet.engine.layers.linear import SplitRows
from kvfleet.engine.layers.quantization.packed import PackedWeights
from kvfleet.engine.layers.triton_merge import merged_values

# (BLOCK_N, BLOCK_K, STEPS, warps): each program takes BLOCK_N outputs over STEPS x BLOCK_K
# inputs; bench/int4_gemm.py's sweep on the H100 at Llama-3-8B's shapes (bench/RESULTS.md):
# with groups of 32 (GGUF's), 8 steps of 32 inputs, 4-bit and 8-bit alike
GEMV_TILES = (64, 128, 2, 4)
# ... and from this many weights (N x K) a layer's: narrower blocks of 4 steps on 2 warps (the
# H200 sweep of session 29 at Llama-3-8B's shapes: gate_up 27.9 us against 29.6, down 16.7
# against 17.4; at qkv and o the first tiles stay faster, 8.9 against 10.0 and 7.0 against 7.9);
# INT4 batch 1 at Llama-3-8B's shape 2.755 -> 2.675 ms (bench/RESULTS.md session 30)
GEMV_TILES_LARGE = (32, 128, 4, 2)
LARGE_GEMV_WEIGHTS = 1 << 25
# (BLOCK_M, BLOCK_N, R, STEPS, warps) of the slice GEMM by row count (up to 16, up to 32), and
# the most rows it takes (above: the dequantizing pass and cuBLAS, faster there). Short
# programs, many of them, measured fastest (fewer splits with more steps each: up to 2x slower)
GEMM_TILES = {16: (16, 128, 32, 2, 4), 32: (32, 64, 32, 2, 4)}
FUSED_ROWS = 32
# One bf16 row through a large 4-bit layer: whole columns to a thread (triton_packed_rows:
# INT4 Llama-3-8B batch 1 2.517 -> 2.321 ms on the H200, bench/RESULTS.md session 44); off for
# A/B timing
ROWS_GEMV = True
# x q 2^-SUBNORMAL_SHIFT is what the one-row kernel sums: activations to 2^43 (far past any
# model's) stay finite when scaled by 2^(149 - SUBNORMAL_SHIFT), products from 2^-62 stay normal.
SUBNORMAL_SHIFT = 64
# An activation's factor for the value at bit b of a word: 2^(149 - SUBNORMAL_SHIFT - b)
_AT_BIT_0 = tl.constexpr(2.0 ** (149 - SUBNORMAL_SHIFT))
_AT_BIT_4 = tl.constexpr(2.0 ** (145 - SUBNORMAL_SHIFT))
_AT_BIT_8 = tl.constexpr(2.0 ** (141 - SUBNORMAL_SHIFT))
_AT_BIT_12 = tl.constexpr(2.0 ** (137 - SUBNORMAL_SHIFT))
_AT_BIT_16 = tl.constexpr(2.0 ** (133 - SUBNORMAL_SHIFT))
_SCALE_BACK = tl.constexpr(2.0**SUBNORMAL_SHIFT)


@triton.jit
def _placed(word, mask):
    """(word & mask) as a float, exactly (below 2^23): OR-ed into 2^23's mantissa, minus 2^23
    (the weight dequantized whole, for the slice GEMM and the dequantizing pass)."""
    return ((word & mask) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _subnormal(word, mask):
    """(word & mask) as a float32 read from its bits: q 2^(b - 149) exactly for a value q at
    bits b.. below bit 23 (a subnormal)."""
    return (word & mask).to(tl.float32, bitcast=True)


@triton.jit
def _words(qweight_ptr, ks, cols, col_ok, N, K, BITS: tl.constexpr):
    """The words [rows, BLOCK_N] holding inputs ks (each row's first) of columns `cols`."""
    return tl.load(
        qweight_ptr + (ks // (32 // BITS))[:, None] * N + cols[None, :],
        mask=(ks < K)[:, None] & col_ok[None, :],
        other=0,
    )


@triton.jit
def _x(x_ptr, perm_ptr, ks, HAS_PERM: tl.constexpr):
    """x[ks] (in the permuted order) as float32; every ks below K."""
    if HAS_PERM:
        ks = tl.load(perm_ptr + ks)
    return tl.load(x_ptr + ks).to(tl.float32)


@triton.jit
def _unpacked_products(packed, x_ptr, perm_ptr, ks, ok, HAS_PERM: tl.constexpr, BITS: tl.constexpr):
    """(sum over each word's values q_j of x[ks + j] q_j 2^-SUBNORMAL_SHIFT [rows, BLOCK_N],
    sum_j x[ks + j] [rows]) for words `packed` [rows, BLOCK_N] whose row r holds inputs ks[r]
    onwards. Rows not `ok` (past K: their words masked to 0) read the first inputs instead, in
    bounds and finite, unmasked (a masked load costs an instruction more), and add nothing."""
    ks = tl.where(ok, ks, 0)
    x0 = _x(x_ptr, perm_ptr, ks, HAS_PERM)
    x1 = _x(x_ptr, perm_ptr, ks + 1, HAS_PERM)
    x2 = _x(x_ptr, perm_ptr, ks + 2, HAS_PERM)
    x3 = _x(x_ptr, perm_ptr, ks + 3, HAS_PERM)
    x4, x5, x6, x7 = x0, x1, x2, x3  # (8 bits: four values a word)
    if BITS == 4:
        x4 = _x(x_ptr, perm_ptr, ks + 4, HAS_PERM)
        x5 = _x(x_ptr, perm_ptr, ks + 5, HAS_PERM)
        x6 = _x(x_ptr, perm_ptr, ks + 6, HAS_PERM)
        x7 = _x(x_ptr, perm_ptr, ks + 7, HAS_PERM)
    return _inputs_products(packed, ok, x0, x1, x2, x3, x4, x5, x6, x7, BITS)


@triton.jit
def _merged_products(packed, parts_ptr, lse_ptr, lse_stride, k0, K, ok,
                     SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                     BITS: tl.constexpr):  # fmt: skip
    """`_unpacked_products` of the step's inputs k0 + [0, BLOCK_K) merged from decode
    attention's unmerged splits (`SplitRows`, `triton_merge.merged_values`), each word
    row's values split out of the merged [BLOCK_K] row."""
    x = merged_values(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS, HEAD_DIM, BLOCK_K)
    if BITS == 4:  # (value j = 4 a + 2 b + c of word row w at [w, a, b, c])
        even, odd = tl.split(tl.reshape(x, [BLOCK_K // 8, 2, 2, 2]))
        even_low, even_high = tl.split(even)
        odd_low, odd_high = tl.split(odd)
        x0, x4 = tl.split(even_low)
        x2, x6 = tl.split(even_high)
        x1, x5 = tl.split(odd_low)
        x3, x7 = tl.split(odd_high)
    else:  # (value j = 2 b + c at [w, b, c])
        even, odd = tl.split(tl.reshape(x, [BLOCK_K // 4, 2, 2]))
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        x4, x5, x6, x7 = x0, x1, x2, x3
    return _inputs_products(packed, ok, x0, x1, x2, x3, x4, x5, x6, x7, BITS)


@triton.jit
def _add_products(acc, words, x0, x1, x2, x3, x4, x5, x6, x7):
    """acc + sum_j x_j q_j 2^-SUBNORMAL_SHIFT over each word's eight 4-bit values q_j (value 5-7
    from the word shifted right by 20), the inputs given scaled by their value's factor
    (`_AT_BIT_*`) and broadcastable to `words`."""
    high = words >> 20
    acc += x0 * _subnormal(words, 0xF)
    acc += x1 * _subnormal(words, 0xF0)
    acc += x2 * _subnormal(words, 0xF00)
    acc += x3 * _subnormal(words, 0xF000)
    acc += x4 * _subnormal(words, 0xF0000)
    acc += x5 * _subnormal(high, 0xF)
    acc += x6 * _subnormal(high, 0xF0)
    acc += x7 * _subnormal(high, 0xF00)
    return acc


@triton.jit
def _inputs_products(packed, ok, x0, x1, x2, x3, x4, x5, x6, x7, BITS: tl.constexpr):
    """`_unpacked_products` of the word rows' inputs x_j [rows] (float32; 8 bits: x0..x3)."""
    if BITS == 4:
        xq = _add_products(
            tl.zeros(packed.shape, tl.float32), packed, (x0 * _AT_BIT_0)[:, None],
            (x1 * _AT_BIT_4)[:, None], (x2 * _AT_BIT_8)[:, None], (x3 * _AT_BIT_12)[:, None],
            (x4 * _AT_BIT_16)[:, None], (x5 * _AT_BIT_0)[:, None], (x6 * _AT_BIT_4)[:, None],
            (x7 * _AT_BIT_8)[:, None],
        )  # fmt: skip
        x_sum = tl.where(ok, x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, 0.0)
    else:  # (8 bits: bytes 2 and 3 from the word shifted right by 16)
        high = packed >> 16
        xq = (x0 * _AT_BIT_0)[:, None] * _subnormal(packed, 0xFF)
        xq += (x1 * _AT_BIT_8)[:, None] * _subnormal(packed, 0xFF00)
        xq += (x2 * _AT_BIT_0)[:, None] * _subnormal(high, 0xFF)
        xq += (x3 * _AT_BIT_8)[:, None] * _subnormal(high, 0xFF00)
        x_sum = tl.where(ok, x0 + x1 + x2 + x3, 0.0)
    return xq, x_sum


@triton.jit
def split_k_total(
    acc, bias, partial_ptr, count_ptr, at, ok, tile, slab, pid_k, SPLIT: tl.constexpr
):  # fmt: skip
    """(out[at] (+ bias) in float32, whether this program has it): this program's part `acc`
    when unsplit; else the part goes into its slab of the partials and the last of the SPLIT
    programs of `tile` to arrive adds the partials in order and resets the tile's counter."""
    total = acc + bias
    last = pid_k >= 0
    if SPLIT > 1:
        tl.store(partial_ptr + pid_k * slab + at, acc, mask=ok)
        tl.debug_barrier()  # (every thread's part written before the count says so)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT - 1
        if last:
            total = acc * 0.0 + bias
            for i in tl.static_range(SPLIT):
                total += tl.load(
                    partial_ptr + i * slab + at, mask=ok, other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(count_ptr + tile, 0)
    return total, last


@triton.jit
def split_k_store(
    acc, bias, partial_ptr, count_ptr, out_ptr, at, ok, tile, slab, pid_k, SPLIT: tl.constexpr
):  # fmt: skip
    """Write this program's float32 part `acc` of out[at] (`split_k_total`): directly when
    unsplit, else the last of the SPLIT programs of `tile` to arrive writes the sum."""
    total, last = split_k_total(acc, bias, partial_ptr, count_ptr, at, ok, tile, slab, pid_k,
                                SPLIT)  # fmt: skip
    if last:
        tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _packed_gemv_kernel(
    x_ptr,  # [K], or SPLITS rows [SPLITS, K] (`SplitRows`' parts)
    lse_ptr,  # [K // HEAD_DIM, lse_stride] float32 (SPLITS: `SplitRows`' lse)
    lse_stride, perm_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, partial_ptr, count_ptr,
    out_ptr, N, K,
    BITS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, GROUP: tl.constexpr,
    PDL: tl.constexpr, SPLITS: tl.constexpr = 0, HEAD_DIM: tl.constexpr = 1,
):  # fmt: skip
    """out [N] = x [K] . W (+ bias), W of BITS (4 or 8) bit values, 32 / BITS to a word.
    BLOCK_K divides the GROUP size (a step is in one group). Launched dependent (PDL), it loads
    its first step's words while the kernel before it finishes, then waits for x (and for the
    workspace, which the kernel before may still be reading). SPLITS: x is decode attention's
    unmerged splits, merged as they are read (whole heads a step: HEAD_DIM divides BLOCK_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    firsts = tl.arange(0, BLOCK_K * BITS // 32) * (32 // BITS)  # each word row's first input
    acc = tl.zeros((BLOCK_K * BITS // 32, BLOCK_N), dtype=tl.float32)
    let_next_start(PDL)
    first = _words(qweight_ptr, pid_k * STEPS * BLOCK_K + firsts, cols, col_ok, N, K, BITS)
    wait_for_previous(PDL)
    for step in tl.static_range(STEPS):
        k0 = (pid_k * STEPS + step) * BLOCK_K
        ok = k0 + firsts < K
        if step == 0:  # noqa: SIM108  (a compile-time choice: no load at step 0)
            packed = first
        else:
            packed = _words(qweight_ptr, k0 + firsts, cols, col_ok, N, K, BITS)
        # (a step past K, in the last program, has its words and inputs masked to 0)
        group = tl.minimum(k0 // GROUP, K // GROUP - 1)
        scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SPLITS:
            xq, x_sum = _merged_products(packed, x_ptr, lse_ptr, lse_stride, k0, K, ok, SPLITS,
                                         HEAD_DIM, BLOCK_K, BITS)  # fmt: skip
        else:
            xq, x_sum = _unpacked_products(packed, x_ptr, perm_ptr, k0 + firsts, ok, HAS_PERM,
                                           BITS)  # fmt: skip
        acc += xq * (scale * _SCALE_BACK)[None, :] - x_sum[:, None] * (zero * scale)[None, :]
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    split_k_store(
        tl.sum(acc, axis=0), bias, partial_ptr, count_ptr, out_ptr, cols, col_ok, pid_n, N, pid_k,
        SPLIT,
    )  # fmt: skip


@triton.jit
def _packed_gemm_kernel(
    xs_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, partial_ptr, count_ptr, out_ptr,
    M, N, K, group_size,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, R: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x . W (+ bias), x given regrouped: xs[m, j, w] = x[m, P w + j] with P =
    32 / BITS values to a word. Program (m, n, s) takes STEPS x R words of K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(STEPS):
        words = (pid_k * STEPS + step) * R + tl.arange(0, R)
        word_ok = words < K * BITS // 32
        ok = word_ok[:, None] & col_ok[None, :]
        packed = tl.load(qweight_ptr + words[:, None] * N + cols[None, :], mask=ok, other=0)
        at = (words * (32 // BITS) // group_size)[:, None] * N + cols[None, :]
        scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
        zero_scale = tl.load(zeros_ptr + at, mask=ok, other=0.0).to(tl.float32) * scale
        for j in tl.static_range(32 // BITS):
            x = tl.load(
                xs_ptr + rows[:, None] * K + (j * (K * BITS // 32) + words)[None, :],
                mask=row_ok[:, None] & word_ok[None, :],
                other=0.0,
            )
            w = (_placed(packed >> (BITS * j), (1 << BITS) - 1) * scale - zero_scale).to(x.dtype)
            acc = tl.dot(x, w, acc, input_precision="ieee" if x.dtype == tl.float32 else "tf32")
    bias = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    split_k_store(
        acc, bias, partial_ptr, count_ptr, out_ptr, rows[:, None] * N + cols[None, :],
        row_ok[:, None] & col_ok[None, :], pid_m * tl.num_programs(1) + pid_n,
        tl.num_programs(0) * BLOCK_M * N, pid_k, SPLIT,
    )  # fmt: skip


@triton.jit
def _dequantize_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, group_size,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out [K, N] = W in out's dtype."""
    k0 = tl.program_id(0) * BLOCK_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    firsts = tl.arange(0, BLOCK_K * BITS // 32) * (32 // BITS)
    ok = (k0 + firsts < K)[:, None] & col_ok[None, :]
    packed = tl.load(
        qweight_ptr + ((k0 + firsts) // (32 // BITS))[:, None] * N + cols[None, :], mask=ok
    )
    groups = (k0 + firsts) // group_size
    at = groups[:, None] * N + cols[None, :]
    scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + at, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(32 // BITS):
        q = _placed(packed >> (BITS * j), (1 << BITS) - 1)
        tl.store(
            out_ptr + (k0 + firsts + j)[:, None] * N + cols[None, :],
            ((q - zero) * scale).to(out_ptr.dtype.element_ty),
            mask=ok,
        )


@dataclass
class SplitWorkspace:
    """What split-K programs keep between them: float32 partials and a counter per output
    tile (zero between calls: the kernels leave them so)."""

    partials: torch.Tensor
    counters: torch.Tensor


# Kernels on one device run in stream order (an engine's steps, eager or replayed from CUDA
# graphs, one after another), so every layer on a device shares one workspace.
_SHARED: dict[torch.device, SplitWorkspace] = {}
_OUTGROWN: list[SplitWorkspace] = []  # (kept: a captured graph may still point into one)


def shared_workspace(device: torch.device, partials: int, counters: int) -> SplitWorkspace:
    """The device's split-K workspace, grown to at least these sizes. Layers reserve what they
    need as they finish loading, before any CUDA graph is captured."""
    have = _SHARED.get(device)
    if have is None or have.partials.numel() < partials or have.counters.numel() < counters:
        size = max(partials, have.partials.numel() if have else 0)
        count = max(counters, have.counters.numel() if have else 0)
        if have is not None:
            _OUTGROWN.append(have)
        have = SplitWorkspace(
            torch.empty(size, dtype=torch.float32, device=device),
            torch.zeros(count, dtype=torch.int32, device=device),
        )
        _SHARED[device] = have
    return have


def gemv_plan(
    n: int, k: int, group_size: int, tiles: tuple[int, int, int, int] | None = None
) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, STEPS, SPLIT, warps) of the one-row kernel for N outputs of K inputs
    (of either width): BLOCK_K a power of two dividing the group size (where the group is
    smaller than the tiles' BLOCK_K, more steps keep the inputs per program), SPLIT the
    programs sharing a column block."""
    default = GEMV_TILES_LARGE if n * k >= LARGE_GEMV_WEIGHTS else GEMV_TILES
    block_n, block_k, steps, warps = tiles or default
    inputs = block_k * steps
    while group_size % block_k:
        block_k //= 2
    if tiles is None:
        steps = inputs // block_k
    return block_n, block_k, steps, cdiv(k, block_k * steps), warps


def gemm_plan(
    m: int, k: int, bits: int = 4, tiles: tuple[int, int, int, int, int] | None = None
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, R, STEPS, SPLIT, warps) of the slice GEMM for M rows and K inputs
    of `bits`-bit words; `tiles` (BLOCK_M, BLOCK_N, R, STEPS, warps) fixes them."""
    block_m, block_n, r, steps, warps = tiles or GEMM_TILES[16 if m <= 16 else 32]
    return block_m, block_n, r, steps, cdiv(k * bits // 32, r * steps), warps


def workspace_sizes(n: int, k: int, group_size: int, bits: int = 4) -> tuple[int, int]:
    """(partials, counters) a layer of N outputs and K inputs needs on either kernel."""
    block_n, _, _, split, _ = gemv_plan(n, k, group_size)
    partials, counters = split * n, cdiv(n, block_n)
    if bits == 4:
        # (the kernels' module takes this one's split-K store: imported where used)
        from kvfleet.engine.layers.quantization.triton_packed_rows import rows_plan, rows_tiles

        rows = rows_tiles(n, k, group_size)
        plan = None if rows is None else rows_plan(n, k, group_size, rows)
        if rows is not None and plan is not None:
            partials, counters = max(partials, plan[0] * n), max(counters, cdiv(n, rows[0]))
    for m in range(2, FUSED_ROWS + 1):
        block_m, gemm_n, _, _, gemm_split, _ = gemm_plan(m, k, bits)
        m_blocks = cdiv(m, block_m)
        partials = max(partials, gemm_split * m_blocks * block_m * n)
        counters = max(counters, m_blocks * cdiv(n, gemm_n))
    return partials, counters


def packed_gemv(
    x: torch.Tensor | SplitRows,
    weights: PackedWeights,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """One row x [1, K] (bf16/fp16/fp32) times the packed weight (+ bias): [1, N] in x's
    dtype; `tiles` (BLOCK_N, BLOCK_K, STEPS, warps). A large 4-bit layer (no act-order) under a
    bf16 row, without `tiles`, takes `triton_packed_rows` instead (ROWS_GEMV). A `SplitRows`
    (no act-order; heads dividing the plan's BLOCK_K, `splits_fit`): decode attention's splits,
    merged as read, in the split-K kernel."""
    left = x if isinstance(x, SplitRows) else None
    row = x.parts if isinstance(x, SplitRows) else x
    k = row.shape[1]
    n = weights.qweight.shape[1]
    if (left is None and ROWS_GEMV and tiles is None and weights.bits == 4
            and weights.perm is None and row.dtype == torch.bfloat16):  # fmt: skip
        from kvfleet.engine.layers.quantization.triton_packed_rows import (
            packed_gemv_rows,
            rows_tiles,
        )

        rows = rows_tiles(n, k, weights.group_size)
        if rows is not None:
            return packed_gemv_rows(row, weights, bias, rows)
    block_n, block_k, steps, split, warps = gemv_plan(n, k, weights.group_size, tiles)
    tiles_n = cdiv(n, block_n)
    space = shared_workspace(row.device, split * n, tiles_n)
    out = torch.empty((1, n), dtype=row.dtype, device=row.device)
    pdl = dependent_launch_args(row.device)
    lse = weights.scales
    merge = {}
    if left is not None:
        assert weights.perm is None, "splits into layers without act-order"
        assert block_k % left.head_dim == 0, "whole heads a step"
        lse, merge = left.lse, {"SPLITS": left.parts.shape[0], "HEAD_DIM": left.head_dim}
    _packed_gemv_kernel[(tiles_n, split)](
        row.contiguous(), lse, lse.stride(0),
        weights.perm if weights.perm is not None else weights.qweight,
        weights.qweight, weights.scales, weights.zeros,
        bias if bias is not None else weights.scales, space.partials, space.counters,
        out, n, k, BITS=weights.bits, HAS_PERM=weights.perm is not None,
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k, STEPS=steps,
        GROUP=weights.group_size, **pdl, num_warps=warps, **merge,
    )  # fmt: skip
    return out


def splits_fit(n: int, k: int, group_size: int, head_dim: int) -> bool:
    """Whether `packed_gemv` merges decode attention's splits of heads of `head_dim` (a step
    of the one-row plan holds whole heads)."""
    return gemv_plan(n, k, group_size)[1] % head_dim == 0


def dequantize_triton(weights: PackedWeights, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` (the permuted input order), in one pass."""
    k = weights.in_features
    n = weights.qweight.shape[1]
    out = torch.empty((k, n), dtype=dtype, device=weights.qweight.device)
    block_k = 64
    _dequantize_kernel[(cdiv(k, block_k), cdiv(n, 128))](
        weights.qweight, weights.scales, weights.zeros, out, n, k, weights.group_size,
        BITS=weights.bits, BLOCK_N=128, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def packed_gemm(
    x: torch.Tensor,
    weights: PackedWeights,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] times the packed weight (+ bias) in the split-K slice GEMM; `tiles` (BLOCK_M,
    BLOCK_N, R, STEPS, warps)."""
    m, k = x.shape
    n = weights.qweight.shape[1]
    if weights.perm is not None:
        x = x[:, weights.perm]
    per = 32 // weights.bits
    xs = x.reshape(m, k // per, per).transpose(1, 2).contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, r, steps, split, warps = gemm_plan(m, k, weights.bits, tiles)
    grid = (cdiv(m, block_m), cdiv(n, block_n), split)
    space = shared_workspace(x.device, split * grid[0] * block_m * n, grid[0] * grid[1])
    _packed_gemm_kernel[grid](
        xs, weights.qweight, weights.scales, weights.zeros,
        bias if bias is not None else weights.scales, space.partials, space.counters, out,
        m, n, k, weights.group_size,
        BITS=weights.bits, HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=block_m,
        BLOCK_N=block_n, R=r, STEPS=steps, num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out


def packed_matmul(
    x: torch.Tensor, weights: PackedWeights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] times the packed weight [K, N] (+ bias): [M, N] in x's dtype. One row: the
    split-K kernel; up to FUSED_ROWS: the slice GEMM; more: the weight dequantized in one pass,
    then cuBLAS."""
    if x.shape[0] == 1:
        return packed_gemv(x, weights, bias)
    if x.shape[0] <= FUSED_ROWS:
        return packed_gemm(x, weights, bias)
    if weights.perm is not None:
        x = x[:, weights.perm]
    w = dequantize_triton(weights, x.dtype)
    if bias is None:
        return x @ w
    return torch.addmm(bias, x, w)
