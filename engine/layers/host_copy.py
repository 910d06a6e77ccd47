"""Host -> device copies that never wait for the device.

A plain `tensor.to("cuda")` synchronizes the stream after copying, so the host would wait for
the step already queued there; the engine prepares step N+1 while step N runs, so its inputs go
through pinned memory with asynchronous copies instead.

The pinned memory is a ring of staging buffers kept for the engine's life, not a fresh
`torch.empty(pin_memory=True)` per copy: PyTorch's pinned allocator gave a prefix hit's step
its first buffer after ~2.4 ms (H200 host, inside the step's 8-ms wall; bench/RESULTS.md
2026-11-28 session 22). A slot is reused a turn of the ring later, once the copy out of it
has run (its event; long done by then: a step makes a few copies).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvfleet.engine.layers.grid import next_power_of_2

SLOTS = 64
_SMALLEST = 4096  # bytes of a slot's first buffer


class _Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.events: list[torch.cuda.Event | None] = [None] * SLOTS
        self.next = 0
        self.lock = threading.Lock()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            slot = self.next
            self.next = (slot + 1) % SLOTS
            event = self.events[slot]
            if event is None:
                event = self.events[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            else:
                event.synchronize()
            buffer = self.buffers[slot]
            if buffer is None or buffer.numel() < nbytes:
                size = max(_SMALLEST, next_power_of_2(nbytes))
                buffer = self.buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            staged = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
            staged.copy_(tensor)
            out = staged.to(self.device, non_blocking=True)
            event.record(torch.cuda.current_stream(self.device))
        return out


_staging: dict[torch.device, _Staging] = {}
_staging_lock = threading.Lock()


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if device.type != "cuda":
        return tensor.to(device)
    staging = _staging.get(device)
    if staging is None:
        with _staging_lock:
            staging = _staging.setdefault(device, _Staging(device))
    return staging.copy(tensor)


def column(
    values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`torch.tensor(values, dtype, device)` without the wait."""
    return to_device(torch.tensor(values, dtype=dtype), device)
