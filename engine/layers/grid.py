"""Integer helpers for kernel launchers: the grid and block sizes of a launch.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions since Triton 3.5: called from
Python they unwrap their arguments first, ~4 us a call, and a launcher takes several. An eager
step (a prompt's, or attention between prefill graph pieces) runs a few a layer: ~0.5-1.5 ms a
step of an 8B model, on the host, where a small step waits for it.
"""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (positive b)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's multiprocessors (4 stands in for a CPU, which the interpreter runs)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
