"""The attention kernels' e4m3 products over an FP8 cache (`triton_decode_e4m3`, the prompt
kernel's E4M3_OPERANDS) under TRITON_INTERPRET on CPU, where their products run in float32: the
operands as the cache holds them, the softmax, masks and splits against the torch backend
reading the same FP8 cache (max |difference| 1e-4; the e4m3 products themselves:
tests/gpu/test_fp8_kv_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.attention import triton_decode, triton_decode_e4m3, triton_prompt
from kvfleet.engine.attention.torch_backend import TorchAttention


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("fused_merge", [True, False])
def test_e4m3_products_decode_matches_torch_over_an_fp8_cache(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    kernel_launches: Callable[..., list[tuple[tuple[int, ...], dict[str, Any]]]],
    num_splits: int,
    sliding_window: int | None,
    fused_merge: bool,
) -> None:
    """The swapped-operand decode kernel (`triton_decode_e4m3`: keys and token-minor values as
    the products' wide side, the softmax down the tokens) over an FP8 cache gives the torch
    backend's output reading the same cache with its scales, at lengths around the tile, block
    and split edges; on the CPU its products run in float32 (the e4m3 ones: tests/gpu)."""
    monkeypatch.setattr(triton_decode, "E4M3_PRODUCTS", True)
    monkeypatch.setattr(triton_decode, "FUSED_MERGE", fused_merge)
    launches = kernel_launches(triton_decode_e4m3, "_DECODE_E4M3")
    seq_lens = [1, 17, 128, 129, 300, 700]
    inputs = attention_case([1] * 6, seq_lens, num_heads=8, num_kv_heads=2, seed=17)
    scales = torch.tensor([0.02, 0.03])
    cache = _fp8_cache(inputs, scales)
    reference = TorchAttention(8, 2, 32, sliding_window=sliding_window)
    metadata = inputs["metadata"]
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, metadata, scales)
    for _ in range(2):  # (the fused merge's counters reset for the next launch)
        out = torch.full_like(inputs["q"], float("nan"))
        triton_decode.decode_attention(inputs["q"], cache, metadata, reference.scale,
                                       sliding_window, out=out, num_splits=num_splits,
                                       kv_scales=scales)  # fmt: skip
        assert not out.isnan().any()
        assert (out - expected).abs().max() < 1e-4
    assert [grid for grid, _ in launches] == [(6, 2, num_splits)] * 2


def test_e4m3_products_take_what_their_products_can() -> None:
    takes = triton_decode_e4m3.takes_e4m3_products
    assert takes(True, True, 128, 4, None)
    assert takes(True, True, 64, 16, None)
    assert takes(True, True, 256, 8, None)
    assert not takes(False, False, 128, 4, None)  # (a bf16 cache: no e4m3 to multiply)
    assert not takes(True, True, 128, 4, 50.0)  # (soft-capped scores: the upcasting kernel)
    assert not takes(True, True, 96, 4, None)
    assert not takes(True, True, 16, 4, None)
    assert not takes(True, True, 128, 32, None)


def _fp8_cache(inputs: dict[str, Any], scales: torch.Tensor) -> torch.Tensor:
    """The case's cache as an FP8 cache holds it (values / scale, saturated at 448)."""
    cache = torch.stack([(inputs["kv_cache"][i] / scales[i]).clamp(-448, 448) for i in (0, 1)])
    return cache.to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "sliding_window", "splits"),
    [
        ([20, 7], [20, 45], None, 1),  # ("few": 64 x 64 tiles; one prompt after a prefix)
        ([1, 150, 37], [90, 200, 150], None, 1),  # ("chunks": 128 x 128, a decode row too)
        ([1, 150, 37], [90, 200, 150], 60, 1),
        ([40, 33], [300, 33], None, 3),  # (keys split three ways, merged after)
    ],
)
def test_e4m3_products_prompt_kernel_matches_torch_over_an_fp8_cache(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    kernel_launches: Callable[..., list[tuple[tuple[int, ...], dict[str, Any]]]],
    query_lens: list[int],
    seq_lens: list[int],
    sliding_window: int | None,
    splits: int,
) -> None:
    """The prompt kernel with E4M3_OPERANDS (keys and token-minor values as the cache holds
    them, the queries quantized a row at a time, the weights as e4m3: here in float32) gives
    the torch backend's output over the same FP8 cache, causal masks, a sliding window and
    split keys included."""
    monkeypatch.setattr(triton_prompt, "E4M3_PRODUCTS", True)
    launches = kernel_launches(triton_prompt, "_PAGED_ATTENTION")
    inputs = attention_case(query_lens, seq_lens, num_heads=4, num_kv_heads=2, seed=23)
    scales = torch.tensor([0.02, 0.03])
    cache = _fp8_cache(inputs, scales)
    reference = TorchAttention(4, 2, 32, sliding_window=sliding_window)
    metadata = inputs["metadata"]
    expected = reference.forward(inputs["q"], inputs["k"], inputs["v"], cache, metadata, scales)
    out = torch.full_like(inputs["q"], float("nan"))
    with triton_prompt.splits_forced(splits):
        triton_prompt.paged_attention(inputs["q"], cache, metadata, reference.scale,
                                      sliding_window, out=out, kv_scales=scales)  # fmt: skip
    assert not out.isnan().any()
    assert (out - expected).abs().max() < 1e-4
    assert [kwargs["E4M3_OPERANDS"] for _, kwargs in launches] == [True]
