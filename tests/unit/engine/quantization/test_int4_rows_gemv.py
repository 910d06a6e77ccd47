"""The one-row 4-bit GEMV with whole columns to a thread (`triton_packed_rows`), in Triton's
interpreter: both forms against the float64 reference and the shipped kernel, at uneven
shapes (a column block and a program partly past N and K), every group layout the checkpoints
give, a bias, activations far apart in size; its plan and `packed_gemv`'s hand-over."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.layers.quantization import triton_packed, triton_packed_rows
from kvfleet.engine.layers.quantization.packed import PackedWeights, pack_rows

# (BLOCK_N, ROWS, warps[, CHUNK]): named 4-row chunks, 8-row tiles, 4-row tiles
FORMS = {"rows": (64, 16, 1), "tile8": (64, 16, 1, 8), "tile4": (32, 8, 2, 4)}


def _weights(n: int, k: int, group: int, seed: int) -> PackedWeights:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=generator)
    zeros = torch.randint(0, 16, (k // group, n), generator=generator).float()
    scales = torch.rand(k // group, n, generator=generator) * 0.02 + 0.001
    return PackedWeights(pack_rows(q), scales.bfloat16(), zeros.bfloat16(), group)


def _reference(x: torch.Tensor, weights: PackedWeights, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weights.dequantize().double()
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(("n", "k", "group"), [(96, 384, 128), (128, 320, 32), (64, 256, 256)])
def test_both_forms_match_the_reference_and_the_shipped_kernel(
    form: str, n: int, k: int, group: int
) -> None:
    """96 x 384: a column block half past N, three programs of 128 inputs in groups of 128;
    128 x 320: groups of 32 (GGUF's), the last program partly past K; 64 x 256: one group a
    row (per channel) over two programs. Twice each: the split counters reset. (8-row tiles
    take groups of at least 64 inputs: there 32 becomes 64.)"""
    tiles = FORMS[form]
    if len(tiles) > 3 and tiles[3]:
        group = max(group, 8 * tiles[3])
    weights = _weights(n, k, group, seed=n + k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    assert triton_packed_rows.rows_plan(n, k, group, tiles) is not None
    want = _reference(x, weights, bias)
    shipped = triton_packed.packed_gemv(x, weights, bias, (32, 32, 4, 2))
    for _ in range(2):
        got = triton_packed_rows.packed_gemv_rows(x, weights, bias, tiles)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=2e-3)
        # (the same float32 sums in another order, rounded to bf16: at most one step apart)
        torch.testing.assert_close(got.float(), shipped.float(), rtol=8e-3, atol=1e-3)
        space = triton_packed.shared_workspace(x.device, 0, 0)
        assert not space.counters.any()


@pytest.mark.parametrize("form", sorted(FORMS))
def test_activations_far_apart_in_size_stay_exact(form: str) -> None:
    """Inputs from 2^-40 to 2^40 in one row: finite and against float64, relative to each
    output's sum of |x w| (the values read as subnormals, the inputs scaled by powers of 2)."""
    n, k = 64, 256
    weights = _weights(n, k, 64, seed=21)
    exponents = (torch.arange(k) % 41 - 20) * 2.0
    signs = torch.randint(0, 2, (k,), generator=torch.Generator().manual_seed(4)) * 2 - 1
    x = (signs * 2.0**exponents).bfloat16()[None, :]
    got = triton_packed_rows.packed_gemv_rows(x, weights, None, FORMS[form]).double()
    want = _reference(x, weights, None)
    scale = x.double().abs() @ weights.dequantize().double().abs()
    assert torch.isfinite(got).all()
    assert ((got - want).abs() / scale).max() < 8e-3  # (the bf16 output's rounding)


def test_the_plan_takes_only_layers_it_can_walk() -> None:
    plan = triton_packed_rows.rows_plan
    assert plan(28672, 4096, 128, (256, 32, 2)) == (16, True)
    assert plan(4096, 14336, 128, (256, 32, 1, 8)) == (56, True)
    assert plan(4000, 4096, 128, (256, 32, 2)) == (16, False)  # (N past the last block)
    assert plan(4096, 4096 + 32, 32, (256, 32, 2)) == (17, False)  # (K past the last program)
    assert plan(4096, 4096 + 32, 32, (256, 32, 1, 8)) is None  # (K not of 8-row chunks)
    assert plan(4096, 4096, 16, (256, 32, 2)) is None  # (a group shorter than a chunk)
    assert plan(4096, 4096, 32, (256, 32, 1, 8)) is None  # (... of 8 rows)
    assert plan(4096, 4096, 96, (256, 32, 2)) is None  # (groups and programs do not nest)
    assert plan(4096, 4096, 128, (256, 30, 2)) is None  # (ROWS not of whole chunks)


def test_large_layers_take_it_by_shape_and_small_ones_do_not() -> None:
    tiles = triton_packed_rows.rows_tiles
    assert tiles(28672, 4096, 128) == triton_packed_rows.WIDE_TILES  # (gate_up)
    assert tiles(4096, 14336, 128) == triton_packed_rows.LONG_TILES  # (down)
    assert tiles(6144, 4096, 128) is None  # (qkv: below 2^25 weights)
    assert tiles(4096, 4096, 128) is None  # (o)
    assert tiles(28672, 4096, 16) is None  # (groups it cannot take)


def test_packed_gemv_hands_large_bf16_layers_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer past the size threshold under a bf16 row goes to the rows kernel, with the
    plan's tiles, and its workspace is reserved; a float32 row, act-order weights, explicit
    tiles or ROWS_GEMV off keep the shipped kernel."""
    n, k, group = 256, 256, 32  # (N >= K: the wide layers' tiles)
    monkeypatch.setattr(triton_packed_rows, "ROWS_FROM_WEIGHTS", n * k)
    monkeypatch.setattr(triton_packed_rows, "WIDE_TILES", FORMS["rows"])
    monkeypatch.setattr(triton_packed_rows, "LONG_TILES", FORMS["tile8"])
    taken: list[tuple[int, ...]] = []
    original = triton_packed_rows.packed_gemv_rows

    def spy(
        x: torch.Tensor, weights: PackedWeights, bias: object, tiles: tuple[int, ...]
    ) -> object:
        taken.append(tiles)
        return original(x, weights, bias, tiles)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_packed_rows, "packed_gemv_rows", spy)
    weights = _weights(n, k, group, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = _reference(x, weights, None)
    torch.testing.assert_close(triton_packed.packed_gemv(x, weights).double(), want,
                               rtol=8e-3, atol=2e-3)  # fmt: skip
    assert taken == [FORMS["rows"]]
    partials, counters = triton_packed.workspace_sizes(n, k, group)
    assert partials >= triton_packed_rows.rows_plan(n, k, group, FORMS["rows"])[0] * n  # type: ignore[index]
    assert counters >= 2
    triton_packed.packed_gemv(x.float(), weights)
    triton_packed.packed_gemv(x, weights, None, (32, 32, 4, 2))
    monkeypatch.setattr(triton_packed, "ROWS_GEMV", False)
    triton_packed.packed_gemv(x, weights)
    assert taken == [FORMS["rows"]]
