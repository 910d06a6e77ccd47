"""Triton W4A16 kernels over engine/layers/quantization/int4.py's layout (qweight [K / 8, N]).

- `_w4a16_gemv_kernel`, one row (decode of one sequence): split-K. Program (n, s) takes
  BLOCK_N output columns over STEPS x BLOCK_K inputs; the SPLIT programs of a column block each
  write a float32 partial and count themselves in; the last to arrive adds the partials in a
  fixed order (the result does not depend on which program finishes last), adds the bias,
  writes the output and resets the counter for the next call. No extra launch, no atomics on
  the data.
  Unpacking costs one logic operation and one add per value: value j of a word, masked where it
  sits (bits 4 j), OR-ed into the mantissa of the float 2^23 reads as 2^23 + 16^j q; minus 2^23
  that is 16^j q exactly, and the activation it meets is pre-divided by 16^j (exact: a power of
  two). Values 5-7 come from the word shifted right by 20 (the mantissa has 23 bits). The scale
  and zero apply once per word row: sum_k x w = s (sum_k x q) - s zero (sum_k x).
- `_dequantize_kernel`: the weight in the activations' dtype, for more rows (prompts, batched
  decode), multiplied by cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.quantization.int4 import Int4Weights

# (BLOCK_N, BLOCK_K, STEPS, warps): each program takes BLOCK_N outputs over STEPS x BLOCK_K
# inputs; bench/int4_gemm.py's sweep on the H100 at Llama-3-8B's shapes (bench/RESULTS.md)
GEMV_TILES = (64, 128, 2, 4)


@triton.jit
def _placed(word, mask):
    """(word & mask) as a float, exactly (below 2^23)."""
    return ((word & mask) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _x(x_ptr, perm_ptr, ks, ok, HAS_PERM: tl.constexpr):
    if HAS_PERM:
        ks = tl.load(perm_ptr + ks, mask=ok, other=0)
    return tl.load(x_ptr + ks, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, perm_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, partial_ptr, count_ptr,
    out_ptr, N, K, group_size,
    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """out [N] = x [K] . W (+ bias). BLOCK_K divides the group size (a step is in one group)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    eights = tl.arange(0, BLOCK_K // 8) * 8
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(STEPS):
        k0 = (pid_k * STEPS + step) * BLOCK_K
        ok = k0 + eights < K
        packed = tl.load(
            qweight_ptr + (k0 // 8 + eights // 8)[:, None] * N + cols[None, :],
            mask=ok[:, None] & col_ok[None, :],
            other=0,
        )
        high = packed >> 20
        # (a step past K, in the last program, has its words and inputs masked to 0)
        group = tl.minimum(k0 // group_size, K // group_size - 1)
        scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        ks = k0 + eights
        x0 = _x(x_ptr, perm_ptr, ks, ok, HAS_PERM)
        x1 = _x(x_ptr, perm_ptr, ks + 1, ok, HAS_PERM)
        x2 = _x(x_ptr, perm_ptr, ks + 2, ok, HAS_PERM)
        x3 = _x(x_ptr, perm_ptr, ks + 3, ok, HAS_PERM)
        x4 = _x(x_ptr, perm_ptr, ks + 4, ok, HAS_PERM)
        x5 = _x(x_ptr, perm_ptr, ks + 5, ok, HAS_PERM)
        x6 = _x(x_ptr, perm_ptr, ks + 6, ok, HAS_PERM)
        x7 = _x(x_ptr, perm_ptr, ks + 7, ok, HAS_PERM)
        xq = x0[:, None] * _placed(packed, 0xF)
        xq += (x1 * 0.0625)[:, None] * _placed(packed, 0xF0)
        xq += (x2 * 0.00390625)[:, None] * _placed(packed, 0xF00)
        xq += (x3 * 0.000244140625)[:, None] * _placed(packed, 0xF000)
        xq += (x4 * 0.0000152587890625)[:, None] * _placed(packed, 0xF0000)
        xq += x5[:, None] * _placed(high, 0xF)
        xq += (x6 * 0.0625)[:, None] * _placed(high, 0xF0)
        xq += (x7 * 0.00390625)[:, None] * _placed(high, 0xF00)
        x_sum = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
        acc += xq * scale[None, :] - x_sum[:, None] * (zero * scale)[None, :]
    out = tl.sum(acc, axis=0)
    if SPLIT == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(partial_ptr + pid_k * N + cols, out, mask=col_ok)
        tl.debug_barrier()  # (every thread's partial written before the count says so)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                total += tl.load(
                    partial_ptr + i * N + cols, mask=col_ok, other=0.0, cache_modifier=".cg"
                )
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _dequantize_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, group_size,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out [K, N] = W in out's dtype."""
    k0 = tl.program_id(0) * BLOCK_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    eights = tl.arange(0, BLOCK_K // 8) * 8
    ok = (k0 + eights < K)[:, None] & col_ok[None, :]
    packed = tl.load(qweight_ptr + (k0 // 8 + eights // 8)[:, None] * N + cols[None, :], mask=ok)
    groups = (k0 + eights) // group_size
    at = groups[:, None] * N + cols[None, :]
    scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + at, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        q = _placed(packed >> (4 * j), 0xF)
        tl.store(
            out_ptr + (k0 + eights + j)[:, None] * N + cols[None, :],
            ((q - zero) * scale).to(out_ptr.dtype.element_ty),
            mask=ok,
        )


@dataclass
class SplitWorkspace:
    """What the split-K kernel keeps between its programs: float32 partials [split, N] and a
    counter per column block (zero between calls; the kernel leaves them so)."""

    partials: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def for_layer(cls, n: int, k: int, group_size: int, device: torch.device) -> SplitWorkspace:
        block_n, _, split, _ = gemv_plan(k, group_size)
        return cls(
            torch.empty(split, n, dtype=torch.float32, device=device),
            torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=device),
        )


def gemv_plan(
    k: int, group_size: int, tiles: tuple[int, int, int, int] | None = None
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, warps) for K inputs: BLOCK_K a power of two dividing the group
    size, SPLIT the programs that share a column block (STEPS x BLOCK_K inputs each)."""
    block_n, block_k, steps, warps = tiles or GEMV_TILES
    while group_size % block_k:
        block_k //= 2
    return block_n, block_k, triton.cdiv(k, block_k * steps), warps


def w4a16_gemv(
    x: torch.Tensor,
    weights: Int4Weights,
    bias: torch.Tensor | None = None,
    workspace: SplitWorkspace | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """One row x [1, K] (bf16/fp16/fp32) times the 4-bit weight (+ bias): [1, N] in x's
    dtype. `workspace`: the layer's (else made here)."""
    k = x.shape[1]
    n = weights.qweight.shape[1]
    block_n, block_k, split, warps = gemv_plan(k, weights.group_size, tiles)
    if (
        workspace is None
        or workspace.partials.shape[0] < split
        or workspace.counters.numel() < triton.cdiv(n, block_n)
    ):
        workspace = SplitWorkspace(
            torch.empty(split, n, dtype=torch.float32, device=x.device),
            torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=x.device),
        )
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    steps = triton.cdiv(triton.cdiv(k, block_k), split)
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x.contiguous(), weights.perm if weights.perm is not None else weights.qweight,
        weights.qweight, weights.scales, weights.zeros,
        bias if bias is not None else weights.scales, workspace.partials, workspace.counters,
        out, n, k, weights.group_size,
        HAS_PERM=weights.perm is not None, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K=block_k, STEPS=steps, num_warps=warps,
    )  # fmt: skip
    return out


def dequantize_triton(weights: Int4Weights, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` (the permuted input order), in one pass."""
    k = weights.qweight.shape[0] * 8
    n = weights.qweight.shape[1]
    out = torch.empty((k, n), dtype=dtype, device=weights.qweight.device)
    block_k = 64
    _dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, 128))](
        weights.qweight, weights.scales, weights.zeros, out, n, k, weights.group_size,
        BLOCK_N=128, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def w4a16_matmul(
    x: torch.Tensor,
    weights: Int4Weights,
    bias: torch.Tensor | None = None,
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:
    """x [M, K] times the 4-bit weight [K, N] (+ bias): [M, N] in x's dtype. One row: the
    split-K kernel; more: the weight dequantized in one pass, then cuBLAS."""
    if x.shape[0] == 1:
        return w4a16_gemv(x, weights, bias, workspace)
    if weights.perm is not None:
        x = x[:, weights.perm]
    w = dequantize_triton(weights, x.dtype)
    if bias is None:
        return x @ w
    return torch.addmm(bias, x, w)
