"""bench/timeline.py's split of a call's wall time between host and GPU."""

from __future__ import annotations

import pytest
import torch

from kvfleet.bench.timeline import profiled_wall, split_wall


def test_overlapping_kernels_count_once_and_gaps_between_them_show() -> None:
    # call from 0 to 10,000 us; kernels 1,000-3,000 and 2,000-4,000 overlap (3 ms busy),
    # a 1 ms gap, then 5,000-8,000; 2 ms tail
    got = split_wall((0.0, 10_000.0), [(5_000.0, 8_000.0), (1_000.0, 3_000.0), (2_000.0, 4_000.0)])
    assert got == {
        "wall_ms": 10.0,
        "lead_ms": 1.0,
        "gpu_busy_ms": 6.0,
        "gpu_gaps_ms": 1.0,
        "tail_ms": 2.0,
    }


def test_a_kernel_inside_another_adds_nothing_and_no_kernels_is_all_lead() -> None:
    assert split_wall((0.0, 4_000.0), [(0.0, 3_000.0), (1_000.0, 2_000.0)])["gpu_busy_ms"] == 3.0
    assert split_wall((0.0, 2_000.0), []) == {
        "wall_ms": 2.0,
        "lead_ms": 2.0,
        "gpu_busy_ms": 0.0,
        "gpu_gaps_ms": 0.0,
        "tail_ms": 0.0,
    }


def test_a_profiled_host_range_is_found_by_its_label() -> None:

    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, torch.profiler.record_function("call"):
        torch.ones(64).sum()
    got = profiled_wall(prof, "call")
    assert got["wall_ms"] > 0
    assert got["lead_ms"] == got["wall_ms"]  # (no GPU: no kernels)
    with pytest.raises(ValueError, match="no host range named 'other'"):
        profiled_wall(prof, "other")
