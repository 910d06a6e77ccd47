"""The 4/8-bit one-row split-K GEMV merging decode attention's unmerged splits as it reads its
row (`SplitRows`, `linear.SPLITS_IN_PACKED_GEMV`), in Triton's interpreter: against the
packed reference over the row merged in torch, splits holding no keys skipped, one split's row
taken as it is, split and unsplit programs, both widths."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.layers.linear import SplitRows
from kvfleet.engine.layers.quantization import triton_packed
from kvfleet.engine.layers.quantization.packed import (
    PackedWeights,
    pack_rows,
    packed_linear_reference,
)

K, N = 256, 64


def _weights(bits: int, group: int) -> PackedWeights:
    generator = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (K, N), generator=generator)
    zeros = torch.randint(0, 1 << bits, (K // group, N), generator=generator).float()
    scales = torch.rand(K // group, N, generator=generator) * 0.02 + 0.001
    return PackedWeights(pack_rows(q, bits=bits), scales, zeros, group, bits=bits)


def _split_rows(head_dim: int, live: list[list[bool]]) -> SplitRows:
    """Four splits of K / head_dim heads; head h's split s holds keys where live[h][s]."""
    heads = K // head_dim
    generator = torch.Generator().manual_seed(head_dim)
    parts = torch.randn(4, K, generator=generator)
    lse = torch.randn(heads, 4, generator=generator) * 3
    lse[~torch.tensor(live)] = float("-inf")
    return SplitRows(parts, lse)


def _merged(rows: SplitRows) -> torch.Tensor:
    """The row the splits make: head by head, each split's row weighted by its share of the
    exp(lse) sum (splits without keys out)."""
    heads, head_dim = rows.lse.shape[0], rows.head_dim
    weights = torch.softmax(rows.lse[:, : rows.parts.shape[0]], dim=1)  # [heads, splits]
    parts = rows.parts.view(-1, heads, head_dim)  # [splits, heads, head_dim]
    return torch.einsum("hs,shd->hd", weights, parts).reshape(1, K)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("head_dim", "tiles"), [(64, (32, 64, 2, 2)), (32, (64, 128, 1, 4))])
def test_the_split_k_gemv_merges_splits_as_it_reads_them(
    bits: int, head_dim: int, tiles: tuple[int, int, int, int]
) -> None:
    """(32, 64, 2, 2): steps of one 64-wide head, two programs a column block; (64, 128, 1,
    4): steps of four 32-wide heads, two programs. Heads with every split, some, one."""
    weights = _weights(bits, 64)
    heads = K // head_dim
    patterns = [[True] * 4, [True, False, True, False], [False, False, True, False]]
    rows = _split_rows(head_dim, [patterns[h % 3] for h in range(heads)])
    bias = torch.randn(N, generator=torch.Generator().manual_seed(9))
    want = packed_linear_reference(_merged(rows), weights, bias)
    for _ in range(2):  # (the split counters reset)
        got = triton_packed.packed_gemv(rows, weights, bias, tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    one = _split_rows(head_dim, [[False, True, False, False]] * heads)
    torch.testing.assert_close(
        triton_packed.packed_gemv(one, weights, None, tiles),
        packed_linear_reference(one.parts[1:2], weights),
        rtol=1e-5, atol=1e-4,
    )  # fmt: skip


def test_splits_fit_where_a_step_holds_whole_heads() -> None:
    assert triton_packed.splits_fit(4096, 4096, 128, 128)  # (Llama-3-8B's o: steps of 128)
    assert triton_packed.splits_fit(4096, 4096, 128, 64)
    assert not triton_packed.splits_fit(3584, 4096, 128, 256)  # (Gemma 2's heads of 256)
    assert not triton_packed.splits_fit(4096, 4096, 32, 128)  # (GGUF's groups: steps of 32)
