"""One-row GEMVs in Triton: decode of one sequence through a linear layer in one kernel, over
e4m3 weights (the row taken as it is, W8A16, `FP8_BF16_ROW`; or quantized to e4m3 inside, both
scales applied) or bf16/fp16 weights.

Each program takes BLOCK_N output rows of the weight over the whole of K, streaming them once
and multiplying on the CUDA cores into a [BLOCK_N, BLOCK_K] float32 accumulator summed once at
the end (a reduction across threads per tile was 2-10x slower). Launched dependent (PDL,
engine/layers/dependent_launch.py), a program loads its first weight tile while the kernel
before it finishes, then waits for x: at batch 1 the weights of consecutive layers stream
with no gap between kernels, which cuBLAS's GEMVs (launched normally) cannot do.

A one-row GEMV can also make its row from what the kernel before would have made: the residual
add + RMSNorm (`UnnormalizedRow`). (It also made act(gate) x up from a gate_up row: 4.418
against 4.280 ms a token at Llama-3-8B bf16 batch 1 on the H200, session 28; dropped.) The
tensor-core GEMV
(`_fp8_gemv_mma_kernel`) puts the weight on the product's 64-row side with one row (or up to
MMA_MAX_ROWS rows) of x as its narrow side and K split over the SMs: e4m3 weights at one row
and at a few rows already quantized. (Its bf16 form lost to cuBLAS at every Llama-3-8B layer
and 2-64 rows on the H200, session 28: o 14.1-26.1 us against 12.4-13.7, down 39.0 against
32.2 at 2 rows; it was dropped.)
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
from kvfleet.engine.layers.grid import cdiv, next_power_of_2, num_sms
from kvfleet.engine.layers.linear import SplitRows, UnnormalizedRow
from kvfleet.engine.layers.quantization.fp8 import _MIN_SCALE, FP8, FP8_MAX
from kvfleet.engine.layers.quantization.triton_fp8 import SUM_SPAN, scaled_to_e4m3
from kvfleet.engine.layers.quantization.triton_packed import (
    shared_workspace,
    split_k_store,
    split_k_total,
)
from kvfleet.engine.layers.triton_gemv_rows import (
    norm_args,
    row_and_norm,
    row_values,
    weight_tile,
    whole_row,
)
from kvfleet.engine.layers.triton_merge import merged_values
from kvfleet.engine.layers.triton_rope import (
    RotaryWrite,
    pair_rows,
    rotary_arguments,
    rotary_write_pairs,
)
from kvfleet.engine.layers.triton_route import Choices, route_rows

# e4m3 weights through `fp8_gemv_mma` (False: the CUDA-core kernel, as before; for A/B runs)
FP8_TENSOR_CORES = True
# e4m3 weights at one row times the row as it is, in the model dtype (W8A16, as FP8 Marlin
# multiplies), on the CUDA cores with the bf16 GEMV's plans (`one_row_plan` at 2 bytes a weight),
# instead of the row quantized to e4m3 first (W8A8, `fp8_gemv_mma`): no largest magnitude found,
# no row quantized a tile, and decode attention's splits merged as read (`SplitRows`) as for
# bf16 weights. The products are exact in float32 either way (bf16 x e4m3: 8 + 4 significant
# bits); the row's e4m3 rounding (2^-4 of a value) is gone. FP8 batch 1 (H200, calls 128-131):
# Llama-3-8B 2.861 / 2.858 / 2.857 / 2.845 / 2.846 -> 2.675 / 2.680 / 2.674 / 2.660 / 2.663 ms,
# Qwen3-8B 3.163 / 3.144 -> 2.912 / 2.897; a layer on the path (call 130's traces): gate_up 36.1
# -> 33.0 us, decode attention 7.8 -> 4.6 (its splits left to o), qkv 11.6 -> 11.4, o and down
# 12.2 -> 11.9. Twice the bf16 plan's inputs a tile with products summed in pairs (its bytes and
# registers: 128 at e4m3 8 x 2,048, sm_90) lost at Llama-3-8B: for o and down 2.699 / 2.698, for
# every layer 2.740 / 2.737, though faster alone (o 7.0 -> 5.6 us, down 20.3 -> 15.7) and at
# Qwen3-8B for every layer (2.800 against 2.897); each 16 bytes' products summed (registers 117
# -> 56 at bf16's 8 x 1,024) lost for bf16 too (Llama-3-8B 3.994 -> 4.349 ms): removed.
FP8_BF16_ROW = True
# e4m3 weights [N, K] whose one-row GEMV under FP8_BF16_ROW takes twice the bf16 plan's inputs a
# tile, each two neighbouring products summed before the accumulator (`_grouped`: the bf16
# plan's bytes a tile and accumulator). At every layer (FP8_ROW_WIDE, removed) it lost at
# Llama-3-8B (2.663 -> 2.737 ms) and won at Qwen3-8B (2.897 -> 2.800, one round; call 131):
# empty until bench/next/call134.sh names the layers (Qwen3-8B's differ in gate_up and down).
PAIRED_E4M3_ROWS: frozenset[tuple[int, int]] = frozenset()


@triton.jit
def split_k_rotary(
    acc, bias, partial_ptr, count_ptr, at, ok, tile, slab, pid_k, out_ptr, cos_ptr, sin_ptr,
    positions_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr, stride_cb,
    stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd, num_heads,
    num_kv_heads, q_norm_ptr, k_norm_ptr, head_count_ptr, qk_eps, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, HALF: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8_CACHE: tl.constexpr,
    QK_NORM: tl.constexpr, QK_OFFSET: tl.constexpr,
):  # fmt: skip
    """`triton_packed.split_k_store` for a qkv projection's row block `tile` (`pair_rows`): the
    last of its SPLIT programs rotates the sum and writes it into out and the KV cache
    (`rotary_write_pairs`)."""
    total, last = split_k_total(acc, bias, partial_ptr, count_ptr, at, ok, tile, slab, pid_k,
                                SPLIT)  # fmt: skip
    if last:
        rotary_write_pairs(total, tile, out_ptr, cos_ptr, sin_ptr, positions_ptr,
                           slot_mapping_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr, stride_cb,
                           stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                           num_heads, num_kv_heads, q_norm_ptr, k_norm_ptr, head_count_ptr,
                           qk_eps, BLOCK_N, HALF, CACHE_BLOCK, FP8_CACHE, QK_NORM,
                           QK_OFFSET)  # fmt: skip


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K], or SPLITS rows [SPLITS, K] (`SplitRows`' parts)
    lse_ptr,  # [K // SPLIT_HEAD_DIM, lse_stride] float32 (SPLITS: `SplitRows`' lse)
    lse_stride,
    w_ptr,  # [N, K] contiguous: e4m3 (QUANTIZE) or the model dtype
    w_scale_ptr,  # [N] float32 (QUANTIZE)
    x_scale_ptr,  # [1] float32 (QUANTIZE and STATIC: the checkpoint's input scale)
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [N]
    residual_ptr,  # [K] (NORM and HAS_RESIDUAL)
    norm_w_ptr,  # [K] the norm's weight (NORM)
    residual_out_ptr,  # [K] x + residual (NORM)
    cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr,
    kv_scales_ptr, stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    stride_vcd, num_heads, num_kv_heads, q_norm_ptr, k_norm_ptr, count_ptr,
    qk_eps,  # (ROTARY: `triton_rope.RotaryWrite`; count_ptr [1] for TOP_K too)
    choice_weights_ptr,  # [TOP_K] float32 out (TOP_K: `triton_route.Choices`)
    choice_ids_ptr,  # [TOP_K] int64 out (TOP_K)
    N, K, fp8_max, min_scale, eps,
    QUANTIZE: tl.constexpr, STATIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
    ROTARY: tl.constexpr, HALF: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8_CACHE: tl.constexpr,
    QK_NORM: tl.constexpr, QK_OFFSET: tl.constexpr, SPLITS: tl.constexpr,
    SPLIT_HEAD_DIM: tl.constexpr, PDL: tl.constexpr, EAGER: tl.constexpr = False,
    SCALED: tl.constexpr = False, TOP_K: tl.constexpr = 0, K_PAD: tl.constexpr = 1,
    E_PAD: tl.constexpr = 1, RENORMALIZE: tl.constexpr = False, GROUP: tl.constexpr = 1,
):  # fmt: skip
    """out [N] = x . w^T (+ bias). SPLITS: x is decode attention's unmerged splits, merged head
    by head as they are read (`merged_values`). QUANTIZE: x quantized to e4m3 as
    `quantize_rows` does (its largest magnitude found first: x is small and stays in L2; or the
    static scale), times both scales (products of e4m3 values are exact in float32). SCALED:
    e4m3 weights times the row as it is, times the weight's scales (`FP8_BF16_ROW`). NORM: the
    row multiplied is RMSNorm(x + residual) (`triton_layers.add_rms_norm`'s values, made here;
    the first program writes x + residual). ROTARY: out is one token's q | k | v (heads of 2 x
    HALF): q rotated into out, k rotated and v written into the KV cache
    (`triton_rope.rotary_write_pairs`), k and v left out of out. EAGER: the splits' rows
    loaded with their lse (`merged_values`). TOP_K: out is a router's logits; the last program
    to store its rows ranks them all into the choices (`moe.route`'s top k, RENORMALIZE)."""
    pid_n = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pair_rows(pid_n, BLOCK_N, HALF) if ROTARY else rows
    col_ok = cols < N
    let_next_start(PDL)
    w_first = weight_tile(w_ptr, cols, col_ok, offsets, K)
    wait_for_previous(PDL)
    x_scale, inv_rms = whole_row(x_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, x_scale_ptr,
                                  pid_n == 0, K, fp8_max, min_scale, eps, ROW_BLOCK,
                                  QUANTIZE and not STATIC, QUANTIZE and STATIC, NORM,
                                  HAS_RESIDUAL, OFFSET)  # fmt: skip
    w_dtype = w_ptr.dtype.element_ty
    acc = _grouped(_products(x_ptr, 0, offsets, K, x_scale, fp8_max, w_first, w_dtype,
                             residual_ptr, norm_w_ptr, inv_rms, lse_ptr, lse_stride, QUANTIZE,
                             NORM, HAS_RESIDUAL, OFFSET, SPLITS, SPLIT_HEAD_DIM, EAGER),
                   GROUP)  # fmt: skip
    for k in range(BLOCK_K, K, BLOCK_K):
        w = weight_tile(w_ptr, cols, col_ok, k + offsets, K)
        acc += _grouped(_products(x_ptr, k, offsets, K, x_scale, fp8_max, w, w_dtype,
                                  residual_ptr, norm_w_ptr, inv_rms, lse_ptr, lse_stride,
                                  QUANTIZE, NORM, HAS_RESIDUAL, OFFSET, SPLITS, SPLIT_HEAD_DIM,
                                  EAGER), GROUP)  # fmt: skip
    out = tl.sum(acc, axis=1)
    if QUANTIZE:
        out = out * x_scale * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    elif SCALED:
        out = out * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ROTARY:
        rotary_write_pairs(out, pid_n, out_ptr, cos_ptr, sin_ptr, positions_ptr,
                           slot_mapping_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr, stride_cb,
                           stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                           num_heads, num_kv_heads, q_norm_ptr, k_norm_ptr, count_ptr, qk_eps,
                           BLOCK_N, HALF, CACHE_BLOCK, FP8_CACHE, QK_NORM,
                           QK_OFFSET)  # fmt: skip
    else:
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)
    if TOP_K:
        _rank_when_last(out_ptr, count_ptr, choice_weights_ptr, choice_ids_ptr, N, TOP_K, K_PAD,
                        E_PAD, RENORMALIZE)  # fmt: skip


@triton.jit
def _rank_when_last(
    logits_ptr, count_ptr, weights_ptr, ids_ptr, N,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """The last program of the grid to store its logits (counted in at `count_ptr`, then
    reset) ranks all N of them, read as stored (L2), into the top k's weights and ids."""
    tl.debug_barrier()  # (every thread's logits written before the count says so)
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        token = tl.arange(0, 1)
        route_rows(logits_ptr, weights_ptr, ids_ptr, token, token >= 0, N, 0, TOP_K, K_PAD,
                    E_PAD, RENORMALIZE, ".cg")  # fmt: skip
        tl.atomic_xchg(count_ptr, 0)


# The e4m3 GEMV on the tensor cores takes 64 weight rows a program (one warpgroup's wgmma M)
# with 4 warps; it takes e4m3 tiles from shared memory as they are, where the CUDA-core GEMV
# spent ~4.6 instructions a weight on upcasts and products (bench/RESULTS.md "2026-11-28
# (session 23)"). Where its row blocks alone are fewer than two an SM, K is cut for about
# MMA_PROGRAMS_PER_SM programs an SM (`fp8_mma_plan`).
MMA_ROWS, MMA_WARPS = 64, 4
MMA_PROGRAMS_PER_SM = 4
# The most rows of x `fp8_rows_mma` takes (the product's columns: 16, 32 or 64).
MMA_MAX_ROWS = 64
# Pipeline stages of the K loop
MMA_STAGES = 3


@triton.jit
def _fp8_gemv_mma_kernel(
    x_ptr,  # [K] in the model dtype, or [M, K] e4m3 (QUANTIZED: rows quantized already)
    x_scales_ptr,  # [M] float32 (QUANTIZED: the rows' scales)
    w_ptr,  # [N, K] e4m3, contiguous
    w_scale_ptr,  # [N] float32
    x_scale_ptr,  # [1] float32 (STATIC)
    bias_ptr,  # [N] (HAS_BIAS)
    partial_ptr,  # [SPLIT, M, N] float32 (SPLIT > 1)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 (SPLIT > 1)
    out_ptr,  # [M, N]
    residual_ptr,  # [K] (NORM and HAS_RESIDUAL)
    norm_w_ptr,  # [K] the norm's weight (NORM)
    residual_out_ptr,  # [K] x + residual (NORM)
    cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr,
    kv_scales_ptr, stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    stride_vcd, num_heads, num_kv_heads, q_norm_ptr, k_norm_ptr, head_count_ptr,
    qk_eps,  # (ROTARY: `triton_rope.RotaryWrite`)
    M, N, K, stride_x, fp8_max, min_scale, eps,
    STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
    QUANTIZED: tl.constexpr, COLS: tl.constexpr, SPAN: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
    ROTARY: tl.constexpr, HALF: tl.constexpr, CACHE_BLOCK: tl.constexpr, FP8_CACHE: tl.constexpr,
    QK_NORM: tl.constexpr, QK_OFFSET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x . w^T (+ bias) with the weight as the product's 64-row side: program
    (n, s) takes BLOCK_N weight rows over STEPS tiles of K, each tile one `tl.dot` of the e4m3
    weight tile with COLS (>= 16, the product's narrowest) columns of x: one row in the model
    dtype quantized here as `quantize_rows` does and broadcast (column 0 is kept), or up to
    COLS rows QUANTIZED already, with their scales. The SPLIT programs of a row block add their
    parts as the 4-bit GEMV's do. NORM (one row): the row is RMSNorm(x + residual), made here
    as `_gemv_kernel` makes it; ROTARY (one row) as `_gemv_kernel` does it, by the last of a
    row block's programs."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pair_rows(pid_n, BLOCK_N, HALF) if ROTARY else rows
    row_ok = rows < N
    offsets = tl.arange(0, BLOCK_K)
    k0 = pid_k * STEPS * BLOCK_K
    let_next_start(PDL)
    w_first = weight_tile(w_ptr, rows, row_ok, k0 + offsets, K)
    wait_for_previous(PDL)
    # (every program finds the whole row's largest magnitude: one load, from L2)
    x_scale, inv_rms = whole_row(x_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, x_scale_ptr,
                                  (pid_n == 0) & (pid_k == 0), K, fp8_max, min_scale, eps,
                                  ROW_BLOCK, not QUANTIZED and not STATIC,
                                  not QUANTIZED and STATIC, NORM, HAS_RESIDUAL,
                                  OFFSET)  # fmt: skip
    tokens = tl.arange(0, COLS)
    acc = tl.zeros([BLOCK_N, COLS], dtype=tl.float32)
    acc = _mma_step(acc, w_first, x_ptr, tokens, M, stride_x, k0 + offsets, K, x_scale,
                    fp8_max, residual_ptr, norm_w_ptr, inv_rms, BLOCK_K, QUANTIZED, SPAN, NORM,
                    HAS_RESIDUAL, OFFSET)  # fmt: skip
    for step in range(1, STEPS):
        ks = k0 + step * BLOCK_K + offsets
        w = weight_tile(w_ptr, rows, row_ok, ks, K)
        acc = _mma_step(acc, w, x_ptr, tokens, M, stride_x, ks, K, x_scale, fp8_max,
                        residual_ptr, norm_w_ptr, inv_rms, BLOCK_K, QUANTIZED, SPAN, NORM,
                        HAS_RESIDUAL, OFFSET)  # fmt: skip
    w_scale = tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if ROTARY:
        part = tl.sum(tl.where(tokens[None, :] == 0, acc, 0.0), axis=1) * x_scale * w_scale
        split_k_rotary(part, bias, partial_ptr, count_ptr, rows, row_ok, pid_n, N, pid_k,
                       out_ptr, cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, k_cache_ptr,
                       v_cache_ptr, kv_scales_ptr, stride_cb, stride_cs, stride_ch, stride_vcb,
                       stride_vcs, stride_vch, stride_vcd, num_heads, num_kv_heads, q_norm_ptr,
                       k_norm_ptr, head_count_ptr, qk_eps, SPLIT, BLOCK_N, HALF, CACHE_BLOCK,
                       FP8_CACHE, QK_NORM, QK_OFFSET)  # fmt: skip
    elif not QUANTIZED:
        part = tl.sum(tl.where(tokens[None, :] == 0, acc, 0.0), axis=1) * x_scale * w_scale
        split_k_store(part, bias, partial_ptr, count_ptr, out_ptr, rows, row_ok, pid_n, N,
                      pid_k, SPLIT)  # fmt: skip
    else:
        token_ok = tokens < M
        x_scales = tl.load(x_scales_ptr + tokens, mask=token_ok, other=0.0)
        part = acc * w_scale[:, None] * x_scales[None, :]
        at = tokens[None, :] * N + rows[:, None]  # (out [M, N] from the [rows, tokens] tile)
        ok = row_ok[:, None] & token_ok[None, :]
        split_k_store(part, bias[:, None], partial_ptr, count_ptr, out_ptr, at, ok, pid_n,
                      M * N, pid_k, SPLIT)  # fmt: skip


@triton.jit
def _mma_step(acc, w, x_ptr, tokens, M, stride_x, ks, K, x_scale, fp8_max, residual_ptr,
              norm_w_ptr, inv_rms, BLOCK_K: tl.constexpr, QUANTIZED: tl.constexpr,
              SPAN: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              OFFSET: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, COLS] += w [BLOCK_N, BLOCK_K] times x's inputs `ks` as e4m3 columns:
    one row (normalized here if NORM) quantized here and broadcast, else rows `tokens` of the
    QUANTIZED x (past M: 0); exact products, summed SPAN at a time in the tensor cores, those
    sums in float32."""
    if not QUANTIZED:
        x = row_values(x_ptr, ks, K, residual_ptr, norm_w_ptr, inv_rms, NORM, HAS_RESIDUAL,
                        OFFSET).to(tl.float32)  # fmt: skip
        xq = scaled_to_e4m3(x, x_scale, fp8_max).to(w.dtype)
        columns = tl.broadcast_to(xq[None, :], [tokens.shape[0], BLOCK_K])
    else:
        columns = tl.load(
            x_ptr + tokens[:, None] * stride_x + ks[None, :],
            mask=(tokens < M)[:, None] & (ks < K)[None, :],
            other=0.0,
        )
    return tl.dot(w, tl.trans(columns), acc, max_num_imprecise_acc=SPAN)


def fp8_mma_plan(
    n: int,
    k: int,
    device: torch.device,
    tiles: tuple[int, int, int] | None = None,
    split: int | None = None,
    rows: int = 1,
) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, STEPS, SPLIT, warps) of the tensor-core e4m3 GEMV for N weight rows
    of K against `rows` rows of x: K cut into SPLIT parts of STEPS tiles (about `split`, if
    given). The fastest of bench/fp8_gemv.py's sweep at Llama-3-8B's shapes on the H200
    (bench/RESULTS.md "2026-11-28 (session 24)"): row blocks at least two an SM take all of K
    (gate_up); fewer cut K for about MMA_PROGRAMS_PER_SM programs an SM (qkv 4 parts, o 8, down
    8), in 512-wide tiles, 256 where K is long (down's 14,336: 2x-longer parts of 512 were 20%
    slower) or where more than 16 rows of x share the tile's shared memory."""
    sms = num_sms(device)
    block_k = 512 if k <= 4096 and rows <= 16 else 256
    block_n, block_k, warps = tiles or (MMA_ROWS, block_k, MMA_WARPS)
    row_blocks = cdiv(n, block_n)
    if split is None:
        split = 1 if row_blocks >= 2 * sms else cdiv(MMA_PROGRAMS_PER_SM * sms, row_blocks)
    tiles_k = cdiv(k, block_k)
    steps = cdiv(tiles_k, max(1, min(split, tiles_k)))
    return block_n, block_k, steps, cdiv(tiles_k, steps), warps


def rows_mma_pays(n: int, k: int, device: torch.device, rows: int) -> bool:
    """Whether `fp8_rows_mma` beats the Triton GEMM for N x K at `rows` rows (2-32), by
    bench/fp8_gemm.py on the H200 (bench/RESULTS.md "2026-11-28 (session 26)"): where its plan
    cuts K over programs, at up to 16 rows (qkv, o, down: 8.4-23.5 us against 12.7-38.1); past
    16 rows only over a long K (down at 32 rows: 25.9 against 38.0; qkv and o 14.4-18.3 against
    13.3-14.5). Where its row blocks alone fill the SMs (gate_up's 448) it is slower (40.6-41.3
    against 32.2-32.6)."""
    if rows > 16 and k <= 4096:
        return False
    return fp8_mma_plan(n, k, device, rows=rows)[3] > 1


def reserve_fp8_gemv(n: int, k: int, device: torch.device) -> None:
    """Grow the device's split-K workspace to what `fp8_gemv_mma` and `fp8_rows_mma` (up to
    MMA_MAX_ROWS rows) take for N x K."""
    for rows in (1, MMA_MAX_ROWS):
        block_n, _, _, split, _ = fp8_mma_plan(n, k, device, rows=rows)
        shared_workspace(device, split * rows * n, cdiv(n, block_n))


def fp8_gemv_mma(
    x: torch.Tensor | UnnormalizedRow,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
    split: int | None = None,
    rotary: RotaryWrite | None = None,
    stages: int = MMA_STAGES,
) -> torch.Tensor:
    """`gemv` over an e4m3 weight on the tensor cores; `tiles`: (BLOCK_N, BLOCK_K, warps),
    `split`: about how many parts K is cut into (default: enough programs an SM); `rotary`
    as `gemv`'s; `stages`: the K loop's pipeline stages."""
    row, _ = row_and_norm(x)
    out = torch.empty((1, weight.shape[0]), dtype=row.dtype, device=row.device)
    _launch_mma(x, None, weight, weight_scale, bias, x_scale, out, tiles, split, rotary, stages)
    return out


def fp8_rows_mma(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: tuple[int, int, int] | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """Up to MMA_MAX_ROWS e4m3 rows x_q [M, K] with their scales [M, 1] (one value expanded:
    a static input scale) times an e4m3 weight [N, K] with its scales [N, 1] (+ bias): [M, N]
    in `out_dtype`, as `torch._scaled_mm` gives it, through the tensor-core GEMV (the weight
    the product's 64-row side, K split over the SMs as for one row): what a decode of a few
    sequences streams is the weight, which no M-wide GEMM tile fills at 2-64 rows."""
    m = x_q.shape[0]
    assert 0 < m <= MMA_MAX_ROWS, m
    assert x_q.stride(1) == 1, "K-contiguous rows"
    out = torch.empty((m, weight.shape[0]), dtype=out_dtype, device=x_q.device)
    scales = x_scale.expand(m, 1).contiguous()  # (the kernel reads a scale a row)
    _launch_mma(x_q, scales, weight, weight_scale, bias, None, out, tiles, split)
    return out


def _launch_mma(
    x: torch.Tensor | UnnormalizedRow,  # one row to quantize (to normalize first), or e4m3 rows
    x_scales: torch.Tensor | None,  # quantized rows' scales [M, 1], or None: one row to quantize
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_scale: torch.Tensor | None,
    out: torch.Tensor,
    tiles: tuple[int, int, int] | None,
    split: int | None,
    rotary: RotaryWrite | None = None,
    stages: int = MMA_STAGES,
) -> None:
    row, norm = row_and_norm(x)
    m, k = row.shape
    n = weight.shape[0]
    block_n, block_k, steps, split, warps = fp8_mma_plan(n, k, row.device, tiles, split, m)
    tiles_n = cdiv(n, block_n)
    space = shared_workspace(row.device, split * m * n, tiles_n + (rotary.heads if rotary else 0))
    pdl = dependent_launch_args(row.device)
    quantized = x_scales is not None
    assert norm is None or not quantized, "a row normalized here is quantized here"
    assert rotary is None or m == 1, "the rotary write takes one token"
    rotary_args, rotary_constants = rotary_arguments(rotary, n, block_n, space.counters[tiles_n:])
    _fp8_gemv_mma_kernel[(tiles_n, split)](
        row, x_scales if quantized else weight_scale, weight, weight_scale,
        x_scale if x_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, space.partials, space.counters, out,
        *norm_args(norm, row), *rotary_args, m, n, k, row.stride(0), FP8_MAX, _MIN_SCALE,
        norm.eps if norm is not None else 0.0, STATIC=x_scale is not None,
        HAS_BIAS=bias is not None, SPLIT=split, STEPS=steps, BLOCK_N=block_n, BLOCK_K=block_k,
        ROW_BLOCK=1 if quantized else next_power_of_2(k), QUANTIZED=quantized,
        COLS=max(16, next_power_of_2(m)), SPAN=min(block_k, SUM_SPAN), NORM=norm is not None,
        HAS_RESIDUAL=norm is not None and norm.residual is not None,
        OFFSET=norm is not None and norm.offset, **rotary_constants, **pdl, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


@triton.jit
def _grouped(products, GROUP: tl.constexpr):
    """[BLOCK_N, BLOCK_K // GROUP]: each GROUP neighbouring products of a row summed (GROUP 1:
    the products as they are), so that the accumulator holds GROUP times fewer values."""
    if GROUP == 1:
        return products
    rows: tl.constexpr = products.shape[0]
    inputs: tl.constexpr = products.shape[1]
    return tl.sum(tl.reshape(products, (rows, inputs // GROUP, GROUP)), axis=2)


@triton.jit
def _products(x_ptr, k0, offsets, K, x_scale, fp8_max, w, w_dtype: tl.constexpr, residual_ptr,
              norm_w_ptr, inv_rms, lse_ptr, lse_stride, QUANTIZE: tl.constexpr,
              NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
              SPLITS: tl.constexpr, SPLIT_HEAD_DIM: tl.constexpr,
              EAGER: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] float32: the row's inputs k0 + offsets (`row_values`, or SPLITS
    `merged_values`; quantized to e4m3 when QUANTIZE) times the weight tile w."""
    if SPLITS > 0:
        x = merged_values(x_ptr, lse_ptr, lse_stride, k0, K, SPLITS, SPLIT_HEAD_DIM,
                           offsets.shape[0], EAGER)  # fmt: skip
    else:
        x = row_values(x_ptr, k0 + offsets, K, residual_ptr, norm_w_ptr, inv_rms, NORM,
                       HAS_RESIDUAL, OFFSET).to(tl.float32)  # fmt: skip
    if QUANTIZE:
        x = scaled_to_e4m3(x, x_scale, fp8_max).to(w_dtype).to(tl.float32)
    return x[None, :] * w.to(tl.float32)


def gemv_tiles(n: int, k: int, weight_bytes: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): for e4m3 the fastest of bench/fp8_gemv.py's sweep at Llama-3-8B's
    shapes (fewer, longer rows per program where N is small); a wider element halves BLOCK_K
    so a tile holds the same bytes."""
    block_n = 8 if n <= 4096 else 16
    block_k = (1024 if n <= 4096 else 512) // weight_bytes
    return block_n, min(block_k, next_power_of_2(k))


# A layer whose programs at 8 rows all fit at once, PRELOAD_PROGRAMS_PER_SM an SM, takes half
# its inputs a tile on 8 warps, up to PRELOAD_MAX_INPUTS (128 registers at [8, 2048], sm_90; [8,
# 4096] takes 235: one an SM, not taken): each program's first half of its weight
# loaded before it waits for the kernel before (decode attention, at batch 1: the DRAM idle)
# where a 512-input tile loaded an eighth. Qwen3-30B-A3B's o (2048 x 4096) 7.27 -> 4.23 us on
# the batch-1 path (floor 4.0), router 3.70 -> 2.96; batch 1 2.919 -> 2.813 ms, Mixtral-8x7B
# (its router) 6.907 -> 6.806 (bench/RESULTS.md session 40, bench/next/call74.sh).
PRELOAD_HALF = True
PRELOAD_PROGRAMS_PER_SM = 2
# (the registers a program of 8 warps may take for two an SM; merging decode attention's splits
# as it reads its row, `SplitRows`, it would take 164-170 uncapped, no stack at 3-4 splits
# capped, sm_90)
PRELOAD_REGISTERS = 65536 // (PRELOAD_PROGRAMS_PER_SM * 8 * 32)
PRELOAD_MAX_INPUTS = 2048
# ... and the whole of K where that fits PRELOAD_MAX_INPUTS (A3B's router, 128 x 2048: none of
# its weight left to load after the wait; bench/next/call78.sh full)
PRELOAD_WHOLE = True
# Merging decode attention's splits (`SplitRows`), a program's loads waited on one another: each
# tile's lse, then the rows of the splits its weights keep, then the weight tile (sm_90 SASS of
# Llama-3-8B's o plan, then 8 x 512 on 4 warps); its o took 14.0 us on the batch-1 path for
# 33.5 MB (floor ~8; bench/RESULTS.md session 45). SPLITS_EAGER: the splits' rows loaded with
# their lse (a split holding no keys read, its stale row not used). With the next weight tile
# also loaded ahead (call 109, two rounds): Llama-3-8B 4.100 -> 4.081 ms, Qwen3-8B 4.330 ->
# 4.276 (each alone: no gain); since WIDE_BF16 (below) those o layers take 8 x 1,024 tiles, with
# no registers for a tile ahead (166 at sm_90), and eager rows alone (call 112's figures).
SPLITS_EAGER = True
# bf16/fp16 layers of up to 4,096 outputs not preloading (Llama-3-8B's and Qwen3-8B's o and down)
# with tiles of 1,024 inputs (8 x 1,024 on 4 warps, all programs resident), the e4m3 sweep's
# bytes a tile doubled, not halved for the wider element: alone (bench/gemv.py, call 111) o
# 12.2 -> 8.7 us (floor 7.9), down 40.1 -> 27.4 (27.8); batch 1 (call 112, two rounds)
# Llama-3-8B 4.080 / 4.082 -> 3.998 / 3.997 ms, Qwen3-8B 4.264 / 4.268 -> 4.167 / 4.164 (4 rows
# a program: 4.063, 4.238). The other shapes it reaches (call 113, two rounds, main against it
# off): Gemma-3-12B 7.122 / 7.117 -> 6.946 / 6.938, Qwen2.5-7B 3.893 / 3.890 -> 3.804 / 3.805,
# Phi-3-mini 3.549 / 3.548 -> 3.474 / 3.472, Mixtral-8x7B 6.737 -> 6.718, Llama-3.2-1B (bound by
# the host) 0.936 / 0.940 / 0.938 -> 0.905 / 0.938 / 0.910 (call 119). Its qkv-like layers at 8
# or 4 x 1,024 instead of WIDE_QKV's 16 x 512 lost though faster alone (call 114: Llama-3-8B
# 3.997 -> 4.006 / 4.006, Qwen3-8B 4.167 -> 4.213 / 4.192, A3B 2.578 -> 2.600 / 2.623).
WIDE_BF16 = True
# 16-row programs take 512 inputs a tile (128 registers, four an SM; 256: 72) where four an SM
# still hold them all: a quarter of each program's weight before the wait, not an eighth.
# Batch 1: Qwen3-30B-A3B 2.806 -> 2.769 ms, Qwen3-8B 4.503 -> 4.406, Gemma-3-12B 7.148 ->
# 7.060, Llama-3-8B 4.152 -> 4.153 (calls 75, 76).
WIDE_QKV = True
WIDE_PROGRAMS_PER_SM = 4
# bf16/fp16 layers' plans measured faster at batch 1 than the rules above give them, by (N, K),
# as vLLM and SGLang ship tuned kernel configs by shape: 8 x 1,024 on 4 warps (WIDE_BF16's) for
# layers of 16-row programs too many for WIDE_QKV. Alone (bench/gemv.py, H200, call 123):
# Phi-3-mini's gate_up 28.9 -> 23.9 us (floor 24.0 at the copy rate), qkv 17.9 -> 15.4 (13.5), LM
# head 49.1 -> 45.3 (46.9); Gemma-3-12B's gate_up 59.6 -> 55.5 (56.2), LM head (262,144 rows of
# its 262,208) 441.6 -> 442.8.
# Batch 1 (calls 123, 124): Phi-3-mini 2.466 / 2.459 / 2.449 -> 2.322 / 2.322 / 2.303 ms,
# Gemma-3-12B 6.946 / 6.946 / 6.869 -> 6.797 / 6.797 / 6.738. Not as a rule: the same plan for
# every such layer lost at Llama-3-8B (3.995 -> 4.054 ms), Qwen3-8B (4.168 -> 4.180) and, K under
# 4,096 only, Qwen2.5-7B (3.767 -> 3.870), whose gate_up layers were at their floor alone either
# way; Qwen3-30B-A3B's LM head unchanged (2.578).
TUNED_ONE_ROW: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (9216, 3072): (8, 1024, 4, 3),  # Phi-3-mini qkv
    (16384, 3072): (8, 1024, 4, 3),  # Phi-3-mini gate_up
    (32064, 3072): (8, 1024, 4, 3),  # Phi-3-mini LM head
    (30720, 3840): (8, 1024, 4, 3),  # Gemma-3-12B gate_up
    (262208, 3840): (8, 1024, 4, 3),  # Gemma-3-12B LM head
}


def one_row_plan(
    n: int, k: int, weight_bytes: int, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the one-row GEMV over a weight [n, k]."""
    if weight_bytes == 2 and (n, k) in TUNED_ONE_ROW:
        return TUNED_ONE_ROW[n, k]
    block_n, block_k = gemv_tiles(n, k, weight_bytes)
    half = next_power_of_2(k) // 2
    if (PRELOAD_HALF and weight_bytes == 2 and block_n == 8 and block_k < half
            and half <= PRELOAD_MAX_INPUTS
            and cdiv(n, block_n) <= PRELOAD_PROGRAMS_PER_SM * num_sms(device)):  # fmt: skip
        whole = PRELOAD_WHOLE and 2 * half <= PRELOAD_MAX_INPUTS
        return block_n, 2 * half if whole else half, 8, 1
    if (WIDE_QKV and weight_bytes == 2 and block_n == 16 and k >= 2048
            and cdiv(n, block_n) <= WIDE_PROGRAMS_PER_SM * num_sms(device)):  # fmt: skip
        return block_n, 2 * block_k, 4, 3
    if WIDE_BF16 and weight_bytes == 2 and block_n == 8:
        return block_n, min(2 * block_k, next_power_of_2(k)), 4, 3
    return block_n, block_k, 4, 3


def takes_rotary(weight: torch.Tensor, half: int, qk_norm: bool = False) -> bool:
    """Whether `gemv(weight, rotary=...)` takes heads of `half` pairs (d, d + half): each
    program's BLOCK_N rows are BLOCK_N / 2 pairs of one head (`triton_rope.pair_rows`); with
    q/k norms, `half` a power of two (a head's last program normalizes it in one tile)."""
    if qk_norm and half != next_power_of_2(half):
        return False
    if weight.dtype == FP8 and FP8_TENSOR_CORES and not FP8_BF16_ROW:
        block_n = MMA_ROWS  # (`fp8_mma_plan`'s)
    else:
        block_n = _plan(weight)[0]
    return half % (block_n // 2) == 0


def _plan(weight: torch.Tensor) -> tuple[int, int, int, int]:
    """`one_row_plan` of the CUDA-core GEMV over `weight`: e4m3 weights times a row as it is
    (`FP8_BF16_ROW`) take the bf16 weights' plan (`PAIRED_E4M3_ROWS`: its BLOCK_K doubled)."""
    n, k = weight.shape
    if weight.dtype == FP8 and FP8_BF16_ROW:
        block_n, block_k, warps, stages = one_row_plan(n, k, 2, weight.device)
        if (n, k) in PAIRED_E4M3_ROWS:
            block_k = min(2 * block_k, next_power_of_2(k))
        return block_n, block_k, warps, stages
    return one_row_plan(n, k, weight.element_size(), weight.device)


def _group(weight: torch.Tensor, scaled: bool) -> int:
    """`_gemv_kernel`'s GROUP over `weight`: 2 for e4m3 rows times a row as it is that
    `PAIRED_E4M3_ROWS` names, else 1."""
    return 2 if scaled and tuple(weight.shape) in PAIRED_E4M3_ROWS else 1


def gemv(
    x: torch.Tensor | UnnormalizedRow | SplitRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    rotary: RotaryWrite | None = None,
    choices: Choices | None = None,
) -> torch.Tensor:
    """One row x [1, K] times weight [N, K] (contiguous) (+ bias): [1, N] in x's dtype (or
    `out_dtype`: float32 for logits, out of the float32 sums as they are). An
    e4m3 weight takes its scales [N, 1] and the row is quantized inside (or with the static
    per-tensor `x_scale`). `tiles`: (BLOCK_N, BLOCK_K, warps, stages). An `UnnormalizedRow`:
    the row multiplied is its RMSNorm, made inside as `triton_layers.add_rms_norm` makes it,
    x + residual written to its `residual_out` (one kernel fewer). `rotary`: the weight is a
    qkv projection's, [q | k | v] heads; q comes out rotated and k, v go into the cache as
    `rotary_and_write_kv` would put them (its columns of the output are left unwritten). A
    `SplitRows` (bf16/fp16 weights): the row is decode attention's splits, merged as read.
    `choices`: the weight is a router's (bf16/fp16/float32), its N logits ranked into them
    (`moe.route`'s top k) by the kernel's last program."""
    if isinstance(x, SplitRows):
        left: SplitRows | None = x
        row, norm = x.parts, None
    else:
        left = None
        row, norm = row_and_norm(x)
    m, k = row.shape
    n = weight.shape[0]
    assert m == 1 or left is not None
    assert row.is_contiguous()
    assert weight.is_contiguous()
    assert (weight.dtype == FP8) == (weight_scale is not None), (
        "e4m3 weights, and only they, take scales"
    )
    scaled = weight_scale is not None and FP8_BF16_ROW
    quantize = weight_scale is not None and not scaled
    assert left is None or not (quantize or rotary), "split rows: not quantized, not rotated"
    assert choices is None or not (weight_scale is not None or rotary or left), "a router's"
    if weight_scale is not None and quantize and tiles is None and FP8_TENSOR_CORES:
        assert out_dtype is None, "the tensor-core GEMV writes x's dtype"
        assert not isinstance(x, SplitRows)
        return fp8_gemv_mma(x, weight, weight_scale, bias, x_scale, rotary=rotary)
    if scaled:
        x_scale = None  # (W8A16: the row is not quantized)
    block_n, block_k, warps, stages = tiles or _plan(weight)
    if left is not None:  # (`merged_values` takes whole heads a tile)
        block_k = max(block_k, left.head_dim)
        assert block_k % left.head_dim == 0, "heads of a power of two"
    out = torch.empty((1, n), dtype=out_dtype or row.dtype, device=row.device)
    pdl = dependent_launch_args(row.device)
    placeholder = weight_scale if weight_scale is not None else out
    whole_row = norm is not None or (quantize and x_scale is None)
    counters = out
    if rotary or choices:
        counters = shared_workspace(row.device, 0, rotary.heads if rotary else 1).counters
    rotary_args, rotary_constants = rotary_arguments(rotary, n, block_n, counters)
    lse = left.lse if left is not None else placeholder
    limits = {"maxnreg": PRELOAD_REGISTERS} if left is not None and warps == 8 else {}
    _gemv_kernel[(cdiv(n, block_n),)](
        row, lse, lse.stride(0), weight, placeholder,
        x_scale if x_scale is not None else placeholder,
        bias if bias is not None else placeholder, out, *norm_args(norm, row),
        *rotary_args, *_choice_args(choices, placeholder), n, k, FP8_MAX,
        _MIN_SCALE, norm.eps if norm is not None else 0.0, QUANTIZE=quantize,
        STATIC=x_scale is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, ROW_BLOCK=next_power_of_2(k) if whole_row else 1,
        NORM=norm is not None,
        HAS_RESIDUAL=norm is not None and norm.residual is not None,
        OFFSET=norm is not None and norm.offset, **rotary_constants,
        SPLITS=m if left is not None else 0, SPLIT_HEAD_DIM=left.head_dim if left else 1, **pdl,
        num_warps=warps, num_stages=stages, EAGER=left is not None and SPLITS_EAGER,
        SCALED=scaled, GROUP=_group(weight, scaled), **_choice_constants(choices, n), **limits,
    )  # fmt: skip
    return out


def _choice_args(choices: Choices | None, placeholder: torch.Tensor) -> list[torch.Tensor]:
    """`_gemv_kernel`'s choice_weights_ptr, choice_ids_ptr."""
    if choices is None:
        return [placeholder, placeholder]
    return [choices.weights, choices.ids]


def _choice_constants(choices: Choices | None, n: int) -> dict[str, int | bool]:
    """`_gemv_kernel`'s TOP_K, K_PAD, E_PAD, RENORMALIZE."""
    if choices is None:
        return {}
    return {"TOP_K": choices.top_k, "K_PAD": next_power_of_2(choices.top_k),
            "E_PAD": next_power_of_2(n), "RENORMALIZE": choices.renormalize}  # fmt: skip
