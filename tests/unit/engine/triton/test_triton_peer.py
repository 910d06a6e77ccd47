"""The fused all-reduce + residual add + RMSNorm kernel (engine/parallel/triton_peer.py) under
TRITON_INTERPRET on CPU, one rank at a time: its peers are played by the test, which puts their
rows into the half of their buffers the call uses and sets their flags (in step, or one call
ahead). The rank must write its rows into its own half, signal every peer with its call count,
and return the norm of the rank-ordered sum exactly as all-reduce-then-`add_rms_norm` does.
The real two-GPU run is tests/gpu/test_async_tp_cuda.py and bench/allreduce.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.layers.triton_layers import add_rms_norm
from kvfleet.engine.parallel import triton_peer

HIDDEN, MAX_ROWS = 64, 4


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (1, 2), (2, 3)])
@pytest.mark.parametrize("programs", [16, 2])  # (2: up to two rows per program)
def test_fused_all_reduce_norm_follows_the_protocol_and_matches_the_unfused(
    rank: int, world: int, programs: int
) -> None:
    gen = torch.Generator().manual_seed(rank * 10 + world)
    half = MAX_ROWS * HIDDEN
    start = 8  # (the lane's halves after another part of the buffer)
    flags_start = start + 2 * half  # (float16 elements; the flags are int32)
    buffers = [
        torch.zeros(flags_start + 2 * programs * world, dtype=torch.float16) for _ in range(world)
    ]
    flags = [b[flags_start:].view(torch.int32).view(programs, world) for b in buffers]
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    counters = torch.zeros(programs, dtype=torch.int32)
    weight = torch.randn(HIDDEN, generator=gen).half()
    lane = triton_peer.Lane(programs, MAX_ROWS, start, half, flags_start * 2 // 4, counters)
    for call, rows in enumerate([1, 3, 4, 2, 1, 4], start=1):
        parts = [torch.randn(rows, HIDDEN, generator=gen).half() for _ in range(world)]
        residual = torch.randn(rows, HIDDEN, generator=gen).half() if rows != 2 else None
        begin = start + (call % 2) * half
        region = slice(begin, begin + rows * HIDDEN)
        for peer in range(world):
            if peer != rank:
                buffers[peer][region] = parts[peer].flatten()
                flags[rank][:, peer] = call + (call == 3)  # one call ahead, once
        got = triton_peer.all_reduce_add_rms_norm(
            parts[rank], residual, weight, 1e-5, bases, lane, rank, world
        )
        total = torch.zeros(rows, HIDDEN)
        for part in parts:
            total += part.float()
        want = add_rms_norm(total.half(), residual, weight, 1e-5)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])
        assert torch.equal(buffers[rank][region], parts[rank].flatten())
        for peer in range(world):
            if peer != rank:
                assert flags[peer][:, rank].tolist() == [call] * programs
        assert counters.tolist() == [call] * programs


def test_lanes_cover_the_rows_with_the_fewest_programs_that_serve_them() -> None:
    from kvfleet.engine.parallel.peer import _lane_shapes

    assert _lane_shapes((16, 256), 1) == [(16, 1)]
    assert _lane_shapes((16, 256), 16) == [(16, 16)]
    assert _lane_shapes((256, 16), 256) == [(16, 16), (256, 256)]
    assert _lane_shapes((16, 256), 300) == [(16, 16), (256, 300)]  # (some with two rows)
    assert _lane_shapes((16, 64, 256), 40) == [(16, 16), (64, 40)]
    assert _lane_shapes((16, 256), 0) == []


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (1, 2), (2, 3)])
def test_two_shot_all_reduce_norm_follows_the_protocol_and_matches_the_unfused(
    rank: int, world: int
) -> None:
    """The two-shot kernel (prefill steps), one rank played for real: it must put its partial
    sums of the rows others own into its parts half, sum its own rows (its part, then the
    peers' from their parts halves, in rank order), put those sums into its sums half, signal
    both exchanges, and take the other rows' sums from their owners' sums halves."""
    programs, max_rows = 2, 12
    gen = torch.Generator().manual_seed(rank * 10 + world)
    half = max_rows * HIDDEN
    parts, sums = 8, 8 + 2 * half  # (after another part of the buffer)
    flags_start = sums + 2 * half  # (float16 elements; the flags are int32)
    buffers = [
        torch.zeros(flags_start + 2 * 2 * programs * world, dtype=torch.float16)
        for _ in range(world)
    ]
    flags = [b[flags_start:].view(torch.int32).view(2, programs, world) for b in buffers]
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    counters = torch.zeros(programs, dtype=torch.int32)
    lane = triton_peer.TwoShotLane(
        programs, max_rows, parts, sums, half, flags_start * 2 // 4, counters
    )
    weight = torch.randn(HIDDEN, generator=gen).half()  # (alike on every rank)
    for call, rows in enumerate([5, 12, 1, 7, 12], start=1):
        partials = [torch.randn(rows, HIDDEN, generator=gen).half() for _ in range(world)]
        residual = torch.randn(rows, HIDDEN, generator=gen).half() if call != 3 else None
        total = torch.zeros(rows, HIDDEN)
        for part in partials:
            total += part.float()
        want = add_rms_norm(total.half(), residual, weight, 1e-5)
        owner = [(row // programs) % world for row in range(rows)]
        offset = (call % 2) * half
        for peer in range(world):
            if peer == rank:
                continue
            for row in range(rows):
                at = slice(offset + row * HIDDEN, offset + (row + 1) * HIDDEN)
                if owner[row] == rank:  # the peer's part of this rank's row
                    buffers[peer][parts:][at] = partials[peer][row]
                elif owner[row] == peer:  # the peer's sum of its own row
                    buffers[peer][sums:][at] = want[1][row]
            flags[rank][:, :, peer] = call
        got = triton_peer.two_shot_add_rms_norm(
            partials[rank], residual, weight, 1e-5, bases, lane, rank, world
        )
        assert torch.equal(got[0], want[0]), f"call {call}: normed"
        assert torch.equal(got[1], want[1]), f"call {call}: residual"
        for row in range(rows):
            at = slice(offset + row * HIDDEN, offset + (row + 1) * HIDDEN)
            if owner[row] == rank:
                assert torch.equal(buffers[rank][sums:][at], want[1][row])
            else:
                assert torch.equal(buffers[rank][parts:][at], partials[rank][row])
        for peer in range(world):
            if peer != rank:
                assert flags[peer][:, :, rank].flatten().tolist() == [call] * 2 * programs
        assert counters.tolist() == [call] * programs
