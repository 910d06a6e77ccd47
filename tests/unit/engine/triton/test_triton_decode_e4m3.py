"""The FP8 cache's decode kernel with e4m3 products (`triton_decode_e4m3`) under TRITON_INTERPRET
on CPU, where its products run in float32: the swapped operands, the softmax down the tokens and
the splits against the torch backend reading the same FP8 cache (max |difference| 1e-4; the
e4m3 products themselves: tests/gpu/test_fp8_kv_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.attention import triton_decode, triton_decode_e4m3
from kvfleet.engine.attention.torch_backend import TorchAttention


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("fused_merge", [True, False])
def test_e4m3_products_decode_matches_torch_over_an_fp8_cache(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
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
    launched: list[tuple[int, ...]] = []
    real = triton_decode_e4m3._DECODE_E4M3

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_decode_e4m3, "_DECODE_E4M3", Spy())
    seq_lens = [1, 17, 128, 129, 300, 700]
    inputs = attention_case([1] * 6, seq_lens, num_heads=8, num_kv_heads=2, seed=17)
    scales = torch.tensor([0.02, 0.03])
    cache = torch.stack([(inputs["kv_cache"][i] / scales[i]).clamp(-448, 448) for i in (0, 1)])
    cache = cache.to(torch.float8_e4m3fn)
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
    assert launched == [(6, 2, num_splits)] * 2


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
