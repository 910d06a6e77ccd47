"""Where the wall time of one engine call goes between host and GPU, from a torch profiler run
(`bench/prefix_probe.py`): the host's lead before the first kernel, the GPU's busy time (the
union of its kernels), its idle gaps inside the span of kernels, and the tail after the last.
A step that is GPU-bound shows a short lead, no gaps and a short tail; a host-bound one, gaps.
"""

from __future__ import annotations

from typing import Any

from torch.profiler import DeviceType


def split_wall(call: tuple[float, float], kernels: list[tuple[float, float]]) -> dict[str, float]:
    """`call` (start, end) on the host and the (start, end) of every kernel it ran, in one
    clock (us): lead, busy, gaps, tail and wall (ms)."""
    start, end = call
    busy = gaps = 0.0
    reach = None  # the end of the kernels seen so far
    for k_start, k_end in sorted(kernels):
        if reach is None or k_start > reach:
            gaps += 0.0 if reach is None else k_start - reach
            busy += k_end - k_start
            reach = k_end
        elif k_end > reach:
            busy += k_end - reach
            reach = k_end
    first = min((k for k, _ in kernels), default=end)
    ms = 1e-3
    return {
        "wall_ms": round((end - start) * ms, 3),
        "lead_ms": round((first - start) * ms, 3),
        "gpu_busy_ms": round(busy * ms, 3),
        "gpu_gaps_ms": round(gaps * ms, 3),
        "tail_ms": round((end - (reach if reach is not None else end)) * ms, 3),
    }


def profiled_wall(prof: Any, label: str) -> dict[str, float]:
    """`split_wall` of the host range `label` (a `torch.profiler.record_function`) in a
    profiler run with CPU and CUDA activities."""
    events = prof.events()
    calls = [e for e in events if e.name == label]
    if not calls:
        raise ValueError(f"no host range named {label!r} in the profile")
    call = calls[0].time_range
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in events
        # (the range itself shows on the device too, as an annotation spanning its kernels)
        if e.device_type == DeviceType.CUDA
        and e.name != label
        and call.start <= e.time_range.start <= call.end
    ]
    return split_wall((call.start, call.end), kernels)
