"""Batched LoRA over a flattened step: each token adds its own adapter's x·Aᵀ·Bᵀ (torch reference).

A step's tokens are grouped by adapter slot (`LoRABatch`), so one pass serves a batch that
mixes many adapters and base-only tokens (which are in no group and pay nothing). The fused
base layers (QKV, gate/up) carry one LoRA per slice: A stacks the slices' ranks
[slots, num_slices * max_rank, in]; B is [slots, out, max_rank], a slice's rows reading only its
own rank columns of the shrunk activations. The Triton kernels (`triton_ops.py`) compute the
same thing; this is their oracle and the CPU path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.engine.layers.host_copy import to_device


@dataclass(frozen=True)
class LoRABatch:
    """Which tokens of a step use which adapter slot, grouped by slot."""

    # [num_tokens] token rows that use an adapter, ordered by slot (base-only tokens absent)
    token_order: torch.Tensor
    # [max_loras + 1] int32: slot s owns token_order[slot_starts[s]:slot_starts[s + 1]]
    slot_starts: torch.Tensor
    slot_starts_cpu: list[int]

    @classmethod
    def build(
        cls, token_slots: np.ndarray, max_loras: int, device: torch.device
    ) -> LoRABatch | None:
        """From each token's slot (`max_loras` for base-only tokens); None when no token uses
        an adapter, so the step runs as the base model alone."""
        counts = np.bincount(token_slots, minlength=max_loras + 1)[:max_loras]
        if not counts.any():
            return None
        order = np.argsort(token_slots, kind="stable")[: int(counts.sum())]
        starts = np.concatenate(([0], np.cumsum(counts)))
        ints = to_device(np.concatenate((order, starts)).astype(np.int32), device)
        return cls(
            token_order=ints[: len(order)],
            slot_starts=ints[len(order) :],
            slot_starts_cpu=starts.tolist(),
        )


class StaticLoRABatch:
    """A CUDA graph's adapter grouping: a `LoRABatch`'s tensors at fixed addresses, into which
    each step copies its own (the LoRA kernels' grids follow the token count alone)."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device) -> None:
        self.token_order = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.slot_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)

    def stage(self, lora: LoRABatch) -> None:
        """Copy a step's grouping in (padding tokens are in no group: the base model alone)."""
        self.token_order[: lora.token_order.shape[0]].copy_(lora.token_order, non_blocking=True)
        self.slot_starts.copy_(lora.slot_starts, non_blocking=True)

    def batch(self, tokens: int) -> LoRABatch:
        """The grouping a graph of `tokens` tokens captures (Triton's LoRA path only: the torch
        one reads host lists, which a graph cannot)."""
        return LoRABatch(self.token_order[:tokens], self.slot_starts, slot_starts_cpu=[])


def add_lora_reference(
    out: torch.Tensor,  # [num_tokens, out_features], updated in place
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [max_loras, num_slices * max_rank, in_features]
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    batch: LoRABatch,
    slice_bounds: Sequence[int],  # [num_slices + 1] output column where each slice starts
) -> None:
    """out[t] += x[t] · A[slot]ᵀ · B[slot]ᵀ per slice, in float32, rounded once into `out`."""
    max_rank = lora_b.shape[2]
    starts = batch.slot_starts_cpu
    for slot in range(len(starts) - 1):
        if starts[slot] == starts[slot + 1]:
            continue
        rows = batch.token_order[starts[slot] : starts[slot + 1]].long()
        shrunk = x[rows].float() @ lora_a[slot].float().t()  # [n, num_slices * max_rank]
        delta = torch.empty(len(rows), out.shape[1], dtype=torch.float32, device=out.device)
        for s in range(len(slice_bounds) - 1):
            lo, hi = slice_bounds[s], slice_bounds[s + 1]
            ranks = shrunk[:, s * max_rank : (s + 1) * max_rank]
            delta[:, lo:hi] = ranks @ lora_b[slot, lo:hi].float().t()
        out[rows] = (out[rows].float() + delta).to(out.dtype)
