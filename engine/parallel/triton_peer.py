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
overwrites a half, every peer has finished the call two back that read it. Every launch runs
all PROGRAMS programs, rows or none, which keeps the counters of all ranks in step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.models.triton_layers import NORM_WARPS, rms_normalize

# Programs per launch, each with at most one row: so the fused path serves up to 16 rows (on
# 2 x H200 in a CUDA graph, hidden 8,192: 1 row 6.4 us against one-shot then the norm's 8.8,
# 16 rows 7.2 against 11.5; at 64 rows, 4 per program, it was twice as slow).
PROGRAMS = 16
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
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,  # [num_rows, hidden]: this rank's partial sums
    residual_ptr,  # [num_rows, hidden], read when HAS_RESIDUAL
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
    rows_offset,  # element offset of the two halves in the symmetric buffer
    half_size,  # elements per half
    flags_offset,  # int32 offset of the flags [PROGRAMS, WORLD] in the symmetric buffer
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
    tl.debug_barrier()  # every thread's rows are written before the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.int32)) + flags_offset
            tl.atomic_xchg(flags + program * WORLD + RANK, count, sem="release", scope="sys")
    own_flags = tl.load(bases_ptr + RANK).to(tl.pointer_type(tl.int32)) + flags_offset
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait_for(own_flags + program * WORLD + peer, count)
    tl.debug_barrier()
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
        tl.store(out_ptr + row * stride_o + cols, rms_normalize(x, weight, hidden, eps), mask=mask)
    tl.store(counters_ptr + program, count)


def all_reduce_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bases: torch.Tensor,
    counters: torch.Tensor,
    layout: tuple[int, int, int],
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum over ranks of `partial` + residual) * weight, that sum + residual).
    `layout`: the element offset of the two halves, elements per half, the int32 offset of the
    flags. Collective: every rank calls it with the same shapes at the same point."""
    num_rows, hidden = partial.shape
    out = torch.empty_like(partial)
    residual_out = torch.empty_like(partial)
    source = residual if residual is not None else partial
    rows_offset, half_size, flags_offset = layout
    _all_reduce_add_rms_norm_kernel[(PROGRAMS,)](
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
        rows_offset,
        half_size,
        flags_offset,
        eps,
        RANK=rank,
        WORLD=world_size,
        PROGRAMS=PROGRAMS,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=NORM_WARPS,
    )
    return out, residual_out
