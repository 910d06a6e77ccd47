"""Triton LoRA shrink/expand against the torch reference, under TRITON_INTERPRET on CPU.

Tolerance: float32 max |difference| 1e-4 (the interpreter's dot is exact float32 math); float16
2e-2 relative to the largest output change (the kernels round the shrunk activations to float16
before the expand, as on the GPU). Base-only rows must come back bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.lora import triton_ops
from kvfleet.engine.lora.ops import LoRABatch, add_lora_reference

MAX_LORAS = 4


def _case(
    token_slots: list[int],
    widths: tuple[int, ...],
    in_features: int,
    max_rank: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(len(token_slots) + max_rank)
    num_slices = len(widths)
    out_features = sum(widths)
    x = torch.randn(len(token_slots), in_features, generator=gen).to(dtype)
    a = (torch.randn(MAX_LORAS, num_slices * max_rank, in_features, generator=gen) / 8).to(dtype)
    b = (torch.randn(MAX_LORAS, out_features, max_rank, generator=gen) / 4).to(dtype)
    out = torch.randn(len(token_slots), out_features, generator=gen).to(dtype)
    return x, a, b, out


@pytest.mark.parametrize(
    "token_slots",
    [
        [0, 4, 2, 2, 1, 4],  # a decode step: one token per request, 4 = base only
        [3] * 20 + [4] * 7 + [0] * 17,  # prefill chunks of two adapters and the base
        [1] * 40,  # one adapter, more tokens than one block
        # every slot one token into its second block: as many blocks as the grid holds
        [0] * 17 + [1] * 17 + [2] * 17 + [3] * 17,
        # a long prefill (blocks of 64): groups of 1, 2 and 3 blocks, the base rows between
        [2] * 150 + [4] * 30 + [0] * 100 + [3] * 30 + [2] * 1,
    ],
    ids=["decode", "prefill", "one-adapter", "ragged", "long-prefill"],
)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("max_rank", [8, 16])
def test_add_lora_matches_reference(
    token_slots: list[int], dtype: torch.dtype, tolerance: float, max_rank: int
) -> None:
    widths = (64, 32, 32)  # a fused QKV layer
    bounds = [0, 64, 96, 128]
    x, a, b, out = _case(token_slots, widths, 192, max_rank, dtype)
    batch = LoRABatch.build(np.array(token_slots), MAX_LORAS, torch.device("cpu"))
    assert batch is not None
    expected = out.clone()
    add_lora_reference(expected, x, a, b, batch, bounds)
    ours = out.clone()
    triton_ops.add_lora(ours, x, a, b, batch, bounds, torch.tensor(bounds, dtype=torch.int32))
    base_rows = torch.tensor(token_slots) == MAX_LORAS
    assert torch.equal(ours[base_rows], out[base_rows])
    change = (expected.float() - out.float()).abs().max()
    assert change > 0.1  # the adapters do something
    error = (ours.float() - expected.float()).abs().max()
    limit = tolerance if dtype == torch.float32 else tolerance * float(change)
    assert error < limit, (float(error), float(change))


def test_no_adapter_tokens_means_no_batch() -> None:
    assert LoRABatch.build(np.array([4, 4, 4]), MAX_LORAS, torch.device("cpu")) is None
