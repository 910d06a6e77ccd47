"""The all-reduce of a row-parallel layer fused with the residual add and RMSNorm after it.

One Triton kernel per decoder sub-layer instead of two (the one-shot all-reduce, then the norm):
each rank copies its partial sums into its half of the symmetric buffer, signals its peers,
waits for theirs, and sums every rank's rows in rank order (so every rank gets the same bits),
then adds the residual and normalizes as `triton_layers.add_rms_norm` does.

Synchronization without a second barrier: program p of every rank counts its calls (a counter
in local memory, so CUDA-graph replays keep counting) and writes rows into half `count % 2` of
the buffer. A rank signals a peer by storing `count` into the peer's flag for (p, rank) with
release semantics, and waits until its own flag for (p, peer) holds `count` or `count + 1` (the
peer can be one call ahead, never two: that would need this rank's next signal). So when a rank
overwrites a half, every peer has finished the call two back that read it. Every launch of a
lane runs all its programs, rows or none, which keeps the counters of all ranks in step.

Lanes: a call runs in the first launch configuration ("lane") with room for its rows: 16
programs for up to 16 rows (batch-1 decode pays for few flag exchanges), 64 for up to 64, 128
for more (one or two rows per program; 4 rows per program in 16 programs ran twice as slow at
64 rows).
Each lane has its own counters, flags and halves, so calls in different lanes never share a
half and the two-call argument above holds per lane.

Prefill steps (thousands of rows) take the two-shot kernel instead: reading every peer's rows
whole would move WORLD times the bytes over NVLink. Row r is owned by rank (r // PROGRAMS) %
WORLD. Each rank puts its partial sums of the rows others own into its buffer; after a first
exchange of flags every owner sums its rows (its own part from its own tensor, the others' from
their buffers, in rank order), adds the residual, normalizes, and puts the sums into its
buffer; after a second exchange every rank reads the others' rows' sums and normalizes them
itself, so all ranks hold the same bits. Ranks only ever write their own buffer. The two halves
alternate by call as above; a rank rewrites a half two calls on, when every peer has passed
both exchanges of the call between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.grid import next_power_of_2
from kvfleet.engine.layers.triton_layers import NORM_WARPS, rms_normalize

# Programs per launch of each lane, the fastest of a sweep (bench/allreduce.py; figures in
# bench/RESULTS.md, "Figures moved out of code comments").
LANES = (16, 64, 128)
# Programs of the two-shot kernel (prefill steps): two per SM of an H100 / H200, all resident at
# once (program p of each rank waits on program p of the others); more bring nothing
# (bench/RESULTS.md, "Figures moved out of code comments").
TWO_SHOT_PROGRAMS = 264
# A peer that never signals (it died mid-step) stops the kernel with a trap after this many
# polls of its flag (tens of seconds), so the process fails instead of hanging.
_MAX_POLLS = tl.constexpr(1 << 26)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_for(flag_ptr, count):
    """Spin until the flag holds `count` or `count + 1` (acquire: the peer's rows are then
    visible)."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    polls = count * 0  # (a tensor, as the loop needs)
    while (seen != count) & (seen != count + 1):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        polls += 1
        if polls > _MAX_POLLS:
            _trap()


@triton.jit
def _exchange(bases_ptr, flags_offset, program, count, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `program`'s barrier with its namesakes on the other ranks: tell each peer this
    rank's writes to its own buffer are done (its flag for (program, RANK) := count, release),
    then wait for theirs (acquire). What every thread of the program wrote to this rank's
    buffer before it, the peers' programs may read after it (ranks write only their own buffer
    and read the others', so no write ever crosses NVLink ahead of its flag)."""
    tl.debug_barrier()  # every thread's writes are done before the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.int32)) + flags_offset
            tl.atomic_xchg(flags + program * WORLD + RANK, count, sem="release", scope="sys")
    own_flags = tl.load(bases_ptr + RANK).to(tl.pointer_type(tl.int32)) + flags_offset
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait_for(own_flags + program * WORLD + peer, count)
    tl.debug_barrier()


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,  # [num_rows, hidden]: this rank's partial sums
    residual_ptr,  # [num_rows, hidden], read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden]: sum + residual (or the sum)
    bases_ptr,  # [WORLD] int64: each rank's symmetric buffer
    counters_ptr,  # [PROGRAMS] int32, this rank's lane: calls made by each program
    stride_p,
    stride_r,
    stride_o,
    stride_ro,
    num_rows,
    hidden,
    rows_offset,  # element offset of the two halves in the symmetric buffer
    half_size,  # elements per half
    flags_offset,  # int32 offset of the lane's flags [PROGRAMS, WORLD] in the symmetric buffer
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    dtype = partial_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    count = tl.load(counters_ptr + program) + 1
    half = rows_offset + (count & 1).to(tl.int64) * half_size
    # (the buffers are 16-byte aligned; so told, the compiler lays rows out as for local ones)
    mine = tl.multiple_of(tl.load(bases_ptr + RANK).to(tl.pointer_type(dtype)), 16) + half
    for row in range(program, num_rows, PROGRAMS):
        x = tl.load(partial_ptr + row * stride_p + cols, mask=mask)
        tl.store(mine + row * hidden + cols, x, mask=mask)
    _exchange(bases_ptr, flags_offset, program, count, RANK, WORLD)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    for row in range(program, num_rows, PROGRAMS):
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for source in tl.static_range(WORLD):
            if source == RANK:
                part = tl.load(partial_ptr + row * stride_p + cols, mask=mask, other=0.0)
            else:
                base = tl.multiple_of(tl.load(bases_ptr + source).to(tl.pointer_type(dtype)), 16)
                # .cg: from the owner's L2, never a stale line of this SM's L1
                part = tl.load(
                    base + half + row * hidden + cols, mask=mask, other=0.0, cache_modifier=".cg"
                )
            total += part.to(tl.float32)
        x = total.to(dtype)
        if HAS_RESIDUAL:
            x = (x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        tl.store(
            out_ptr + row * stride_o + cols, rms_normalize(x, weight, hidden, eps, False), mask=mask
        )
    tl.store(counters_ptr + program, count)


@dataclass(frozen=True)
class Lane:
    """One launch configuration's part of the symmetric buffer and its counters."""

    programs: int
    max_rows: int
    rows_offset: int  # element offset of its two halves in the symmetric buffer
    half_size: int  # elements per half (max_rows x hidden)
    flags_offset: int  # int32 offset of its flags [programs, WORLD]
    counters: torch.Tensor  # [programs] int32, this rank's (local memory)


def all_reduce_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bases: torch.Tensor,
    lane: Lane,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum over ranks of `partial` + residual) * weight, that sum + residual), in
    `lane` (`partial` has at most lane.max_rows rows). Collective: every rank calls it with the
    same shapes at the same point."""
    offsets = (lane.rows_offset, lane.half_size, lane.flags_offset)
    return _launch(
        _all_reduce_add_rms_norm_kernel,
        offsets,
        partial,
        residual,
        weight,
        eps,
        bases,
        lane.counters,
        lane.programs,
        rank,
        world_size,
    )


@triton.jit
def _two_shot_add_rms_norm_kernel(
    partial_ptr,  # [num_rows, hidden]: this rank's partial sums
    residual_ptr,  # [num_rows, hidden], read when HAS_RESIDUAL (the same on every rank)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden]: sum + residual (or the sum)
    bases_ptr,  # [WORLD] int64: each rank's symmetric buffer
    counters_ptr,  # [PROGRAMS] int32, this rank's: calls made by each program
    stride_p,
    stride_r,
    stride_o,
    stride_ro,
    num_rows,
    hidden,
    parts_offset,  # element offset of the two halves of partial rows for their owners
    sums_offset,  # element offset of the two halves of owned rows' sums
    half_size,  # elements per half
    flags_offset,  # int32 offset of the flags [2, PROGRAMS, WORLD]: rows parted, sums made
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    dtype = partial_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    count = tl.load(counters_ptr + program) + 1
    half = (count & 1).to(tl.int64) * half_size
    stride = PROGRAMS * WORLD  # row r is owned by rank (r // PROGRAMS) % WORLD
    mine = tl.multiple_of(tl.load(bases_ptr + RANK).to(tl.pointer_type(dtype)), 16)
    # 1. this rank's partial sums of the rows the others own, where they can read them
    for owner in tl.static_range(WORLD):
        if owner != RANK:
            for row in range(program + owner * PROGRAMS, num_rows, stride):
                x = tl.load(partial_ptr + row * stride_p + cols, mask=mask)
                tl.store(mine + parts_offset + half + row * hidden + cols, x, mask=mask)
    _exchange(bases_ptr, flags_offset, program, count, RANK, WORLD)
    # 2. the rows this rank owns: every rank's part in rank order, the residual, the norm
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    for row in range(program + RANK * PROGRAMS, num_rows, stride):
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for source in tl.static_range(WORLD):
            if source == RANK:
                part = tl.load(partial_ptr + row * stride_p + cols, mask=mask, other=0.0)
            else:
                base = tl.multiple_of(tl.load(bases_ptr + source).to(tl.pointer_type(dtype)), 16)
                part = tl.load(
                    base + parts_offset + half + row * hidden + cols,
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            total += part.to(tl.float32)
        x = total.to(dtype)
        if HAS_RESIDUAL:
            x = (x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)).to(dtype)
        tl.store(mine + sums_offset + half + row * hidden + cols, x, mask=mask)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        tl.store(
            out_ptr + row * stride_o + cols, rms_normalize(x, weight, hidden, eps, False), mask=mask
        )
    _exchange(bases_ptr, flags_offset + PROGRAMS * WORLD, program, count, RANK, WORLD)
    # 3. the rows the others own: their sums (so every rank holds the same bits), the norm
    for owner in tl.static_range(WORLD):
        if owner != RANK:
            base = tl.multiple_of(tl.load(bases_ptr + owner).to(tl.pointer_type(dtype)), 16)
            for row in range(program + owner * PROGRAMS, num_rows, stride):
                x = tl.load(
                    base + sums_offset + half + row * hidden + cols,
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
                tl.store(
                    out_ptr + row * stride_o + cols,
                    rms_normalize(x, weight, hidden, eps, False),
                    mask=mask,
                )
    tl.store(counters_ptr + program, count)


@dataclass(frozen=True)
class TwoShotLane:
    """The two-shot kernel's part of the symmetric buffer and its counters."""

    programs: int
    max_rows: int
    parts_offset: int  # element offset of the two halves of parted rows
    sums_offset: int  # element offset of the two halves of owned rows' sums
    half_size: int  # elements per half (max_rows x hidden)
    flags_offset: int  # int32 offset of its flags [2, programs, WORLD]
    counters: torch.Tensor  # [programs] int32, this rank's (local memory)


def two_shot_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bases: torch.Tensor,
    lane: TwoShotLane,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `all_reduce_add_rms_norm`, for many rows (prefill steps): each rank sums and
    normalizes the rows it owns, then takes the others' sums from their owners (residual and
    weight must be the same on every rank, as they are in a tensor-parallel model)."""
    offsets = (lane.parts_offset, lane.sums_offset, lane.half_size, lane.flags_offset)
    return _launch(
        _two_shot_add_rms_norm_kernel,
        offsets,
        partial,
        residual,
        weight,
        eps,
        bases,
        lane.counters,
        lane.programs,
        rank,
        world_size,
    )


def _launch(
    kernel: Any,
    offsets: tuple[int, ...],
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bases: torch.Tensor,
    counters: torch.Tensor,
    programs: int,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused kernel over `programs` programs; `offsets`: its lane's places in the
    symmetric buffer, in the kernel's order."""
    num_rows, hidden = partial.shape
    out = torch.empty_like(partial)
    residual_out = torch.empty_like(partial)
    source = residual if residual is not None else partial
    kernel[(programs,)](
        partial,
        source,
        weight,
        out,
        residual_out,
        bases,
        counters,
        partial.stride(0),
        source.stride(0),
        out.stride(0),
        residual_out.stride(0),
        num_rows,
        hidden,
        *offsets,
        eps,
        RANK=rank,
        WORLD=world_size,
        PROGRAMS=programs,
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_power_of_2(hidden),
        num_warps=NORM_WARPS,
    )
    return out, residual_out
