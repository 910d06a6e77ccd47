"""Triton KV write and paged attention against the torch backend, under TRITON_INTERPRET on CPU.

Tolerance: float32 max |difference| 1e-4 (the interpreter's dot is exact float32 math); float16
2e-3. Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.attention import triton_attention
from kvfleet.engine.attention.torch_backend import TorchAttention

CASES = {
    "decode-only": ([1, 1, 1], [5, 40, 77]),
    "prefill-with-prefix": ([20, 7], [20, 45]),
    "mixed": ([1, 33, 1, 70], [90, 33, 17, 100]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.float16, 2e-3)])
def test_write_and_attend_match_torch(
    attention_case: Callable[..., dict[str, Any]], case: str, dtype: torch.dtype, tolerance: float
) -> None:
    query_lens, seq_lens = CASES[case]
    inputs = attention_case(query_lens, seq_lens, dtype=dtype, seed=list(CASES).index(case))
    reference = TorchAttention(4, 2, 32)
    cache_ref = inputs["kv_cache"].clone()
    expected = reference.forward(
        inputs["q"], inputs["k"], inputs["v"], cache_ref, inputs["metadata"]
    )

    cache = inputs["kv_cache"].clone()
    triton_attention.write_kv_cache(
        inputs["k"], inputs["v"], cache, inputs["metadata"].slot_mapping
    )
    assert torch.equal(cache, cache_ref)
    out = torch.full_like(inputs["q"], float("nan"))
    triton_attention.paged_attention(
        inputs["q"], cache, inputs["metadata"], reference.scale, out=out
    )
    assert not out.isnan().any()
    assert (out.float() - expected.float()).abs().max() < tolerance


def test_sliding_window(attention_case: Callable[..., dict[str, Any]]) -> None:
    inputs = attention_case([1, 30], [70, 50], seed=7)
    reference = TorchAttention(4, 2, 32, sliding_window=24)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, inputs["metadata"])
    out = triton_attention.TritonAttention(4, 2, 32, sliding_window=24).forward(
        inputs["q"], inputs["k"], inputs["v"], inputs["kv_cache"], inputs["metadata"]
    )
    assert (out - expected).abs().max() < 1e-4
