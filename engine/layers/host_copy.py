"""Host -> device copies that never wait for the device.

A plain `tensor.to("cuda")` synchronizes the stream after copying, so the host would wait for
the step already queued there; the engine prepares step N+1 while step N runs, so its inputs go
through pinned memory with asynchronous copies instead (the pinned block is held until its copy
is done).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    if device.type != "cuda":
        return tensor.to(device)
    # (not `tensor.pin_memory()`: its check of whether the source is pinned costs more than
    # the copy, bench/RESULTS.md)
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor).to(device, non_blocking=True)


def column(
    values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`torch.tensor(values, dtype, device)` without the wait."""
    return to_device(torch.tensor(values, dtype=dtype), device)
