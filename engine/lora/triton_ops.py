"""Batched LoRA in Triton: a grouped shrink (x·Aᵀ) and expand (·Bᵀ, added into the output).

Both kernels take the step's tokens grouped by adapter slot (`LoRABatch`): a program owns one
slot's block of tokens, so a prefill chunk reads its adapter's A/B tiles once for many tokens
(SGMV-style segments), and a decode batch with one token per request groups the requests that
share an adapter (BGMV-style gathers, done once per group instead of once per token). Programs
are numbered over the step's (slot, block of that slot's tokens) pairs, slot by slot, each
finding its own from the slots' token counts; the grid holds as many as any grouping of the
step's tokens can need (blocks + slots - 1), not a block of every slot for every block of
tokens (a 32k-token prefill over 8 slots: 519 programs a column, not 16,384). So it depends only
on the slot count and the token count, and a launch captured in a CUDA graph stays valid for any
grouping of the same number of tokens. Tokens in no group (base model only) are
never touched. The shrink splits the input dimension so that a decode step still fills the GPU;
the expand sums the partial products as it loads them (no atomics, a fixed order).

`ops.add_lora_reference` is the oracle.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.grid import cdiv, next_power_of_2
from kvfleet.engine.lora.ops import LoRABatch

# A step of at most this many tokens is a decode step: blocks of 16 tokens, the shrink's input
# split in SHRINK_COLUMNS a program (at most 32 parts) so that it still fills the GPU; more
# (a prefill): blocks of 64, the input whole. (bench/lora_layer.py sweeps them.)
DECODE_TOKENS = 256
SHRINK_COLUMNS = 512
SHRINK_BLOCK_K = 64
# The expand's output columns a program (halved until it divides every slice's width).
EXPAND_COLUMNS = 128


@triton.jit
def _group_rows(
    token_order_ptr,
    slot_starts_ptr,
    block,
    max_loras,
    BLOCK_M: tl.constexpr,
    SLOTS_PAD: tl.constexpr,  # next_power_of_2(max_loras)
):
    """The `block`-th block of the step's (slot, BLOCK_M tokens of that slot) pairs, counted
    slot by slot: its slot, token rows and which of them exist, and whether it is a block at
    all (the grid holds as many programs as any grouping of the step's tokens can need)."""
    slots = tl.arange(0, SLOTS_PAD)
    real = slots < max_loras
    starts = tl.load(slot_starts_ptr + slots, mask=real, other=0)
    ends = tl.load(slot_starts_ptr + slots + 1, mask=real, other=0)
    blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    after = tl.cumsum(blocks, 0)  # blocks up to and including each slot's
    slot = tl.sum((after <= block).to(tl.int32), 0)
    mine = slots == slot
    m_block = block - tl.sum(tl.where(mine, after - blocks, 0), 0)
    start = tl.sum(tl.where(mine, starts, 0), 0) + m_block * BLOCK_M
    end = tl.sum(tl.where(mine, ends, 0), 0)
    offs = start + tl.arange(0, BLOCK_M)
    valid = offs < end
    rows = tl.load(token_order_ptr + offs, mask=valid, other=0).to(tl.int64)
    return slot, rows, valid, slot < max_loras


@triton.jit
def _shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [max_loras, num_slices * max_rank, in_features]
    partial_ptr,  # [split_k, num_tokens, num_slices * max_rank] float32
    token_order_ptr,  # [num_lora_tokens] int32
    slot_starts_ptr,  # [max_loras + 1] int32
    num_tokens,
    max_loras,
    in_features,
    total_rank,  # num_slices * max_rank
    k_per_split,
    stride_x,
    stride_al,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_R_BLOCKS: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding)
):
    split = tl.program_id(1) // NUM_R_BLOCKS
    r_block = tl.program_id(1) % NUM_R_BLOCKS
    slot, rows, valid, any_rows = _group_rows(
        token_order_ptr, slot_starts_ptr, tl.program_id(0), max_loras, BLOCK_M, SLOTS_PAD
    )
    if any_rows:
        offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < total_rank
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, in_features)
        for k in range(k_begin, k_end, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                mask=valid[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                a_ptr + slot * stride_al + offs_r[:, None] * stride_ar + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc, input_precision=DOT_PRECISION)
        tl.store(
            partial_ptr + (split * num_tokens + rows[:, None]) * total_rank + offs_r[None, :],
            acc,
            mask=valid[:, None] & r_mask[None, :],
        )


@triton.jit
def _expand_kernel(
    partial_ptr,  # [split_k, num_tokens, num_slices * max_rank] float32
    b_ptr,  # [max_loras, out_features, max_rank]
    out_ptr,  # [num_tokens, out_features], updated in place
    token_order_ptr,
    slot_starts_ptr,
    slice_starts_ptr,  # [num_slices + 1] int32: each slice's first output column
    num_tokens,
    max_loras,
    out_features,
    max_rank,
    stride_bl,
    stride_bn,
    stride_o,
    SPLIT_K: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n_block = tl.program_id(1)
    slot, rows, valid, any_rows = _group_rows(
        token_order_ptr, slot_starts_ptr, tl.program_id(0), max_loras, BLOCK_M, SLOTS_PAD
    )
    if any_rows:
        # NOTE: BLOCK_N divides every slice's width, so a block lies inside one slice.
        n0 = n_block * BLOCK_N
        slice_index = 0
        for s in tl.static_range(1, NUM_SLICES):
            slice_index += (tl.load(slice_starts_ptr + s) <= n0).to(tl.int32)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_features
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < max_rank
        total_rank = NUM_SLICES * max_rank
        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            h += tl.load(
                partial_ptr
                + (split * num_tokens + rows[:, None]) * total_rank
                + slice_index * max_rank
                + offs_r[None, :],
                mask=valid[:, None] & r_mask[None, :],
                other=0.0,
            )
        b = tl.load(
            b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        delta = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + rows[:, None] * stride_o + offs_n[None, :]
        mask = valid[:, None] & n_mask[None, :]
        out = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out.dtype), mask=mask)


def _block_m(num_tokens: int) -> int:
    # A prefill's groups are long: larger blocks read each adapter's A and B fewer times.
    return 16 if num_tokens <= DECODE_TOKENS else 64


def _pairs(num_tokens: int, max_loras: int, block_m: int) -> int:
    # At most this many (slot, block) pairs: cdiv(a, B) + cdiv(b, B) <= cdiv(a + b, B) + 1.
    return cdiv(num_tokens, block_m) + min(max_loras, num_tokens) - 1


def new_partial(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """The shrink's output for `x`: [split_k, num_tokens, num_slices * max_rank] float32 (a
    decode step splits the input dimension so that the shrink still fills the GPU)."""
    num_tokens, in_features = x.shape
    decode = num_tokens <= DECODE_TOKENS
    split_k = min(32, cdiv(in_features, SHRINK_COLUMNS)) if decode else 1
    return torch.empty((split_k, num_tokens, lora_a.shape[1]), dtype=torch.float32, device=x.device)


def shrink(
    partial: torch.Tensor,  # from new_partial(x, lora_a), written
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [max_loras, num_slices * max_rank, in_features]
    batch: LoRABatch,
) -> None:
    """partial[:, t] = the parts of x[t] · A[slot]ᵀ over the input's splits."""
    num_tokens, in_features = x.shape
    max_loras, total_rank, _ = lora_a.shape
    split_k = partial.shape[0]
    x = x.contiguous()
    block_m = _block_m(num_tokens)
    block_k = SHRINK_BLOCK_K
    k_per_split = cdiv(cdiv(in_features, split_k), block_k) * block_k
    block_r = min(64, max(16, next_power_of_2(total_rank)))
    r_blocks = cdiv(total_rank, block_r)
    _shrink_kernel[(_pairs(num_tokens, max_loras, block_m), split_k * r_blocks)](
        x, lora_a, partial, batch.token_order, batch.slot_starts, num_tokens, max_loras,
        in_features, total_rank, k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, NUM_R_BLOCKS=r_blocks,
        SLOTS_PAD=next_power_of_2(max_loras), DOT_PRECISION=_precision(x),
    )  # fmt: skip


def expand(
    out: torch.Tensor,  # [num_tokens, out_features], updated in place
    partial: torch.Tensor,  # the shrink's
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    batch: LoRABatch,
    slice_bounds: Sequence[int],
    slice_starts: torch.Tensor,  # slice_bounds on the device, int32
) -> None:
    """out[t] += (the sum of partial[:, t]) · B[slot]ᵀ per slice."""
    split_k, num_tokens, _ = partial.shape
    max_loras, out_features, max_rank = lora_b.shape
    widths = [hi - lo for lo, hi in itertools.pairwise(slice_bounds)]
    block_n = EXPAND_COLUMNS
    while any(w % block_n for w in widths):
        block_n //= 2
    assert block_n >= 16, f"slice widths {widths} need a common power-of-two divisor >= 16"
    block_m = _block_m(num_tokens)
    _expand_kernel[(_pairs(num_tokens, max_loras, block_m), cdiv(out_features, block_n))](
        partial, lora_b, out, batch.token_order, batch.slot_starts, slice_starts, num_tokens,
        max_loras, out_features, max_rank, lora_b.stride(0), lora_b.stride(1), out.stride(0),
        SPLIT_K=split_k, NUM_SLICES=len(widths), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, next_power_of_2(max_rank)), SLOTS_PAD=next_power_of_2(max_loras),
        DOT_PRECISION=_precision(out),
    )  # fmt: skip


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def add_lora(
    out: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [max_loras, num_slices * max_rank, in_features]
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    batch: LoRABatch,
    slice_bounds: Sequence[int],
    slice_starts: torch.Tensor,  # slice_bounds on the device, int32
) -> None:
    """out[t] += x[t] · A[slot]ᵀ · B[slot]ᵀ per slice (as `ops.add_lora_reference`)."""
    partial = new_partial(x, lora_a)
    shrink(partial, x, lora_a, batch)
    expand(out, partial, lora_b, batch, slice_bounds, slice_starts)
