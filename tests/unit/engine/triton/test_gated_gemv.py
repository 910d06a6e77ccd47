"""act(gate) x up made by a gate_up projection's one-row GEMV (`gemv(..., gated=...)`,
`Linear.forward_gated`, `linear.GATED_IN_GEMV`) in the interpreter: bit for bit what the GEMV
then `act_and_mul`'s kernel make, SiLU and GeGLU, float32 and float16, a program half past the
inner size, a bias, a row normalized inside."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.layers import linear, triton_layers
from kvfleet.engine.layers.linear import Linear, UnnormalizedRow
from kvfleet.engine.layers.torch_layers import gated_inner
from kvfleet.engine.layers.triton_gemv import gemv

INNER, K = 36, 200


def _gate_up(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    weight = (torch.randn(2 * INNER, K, generator=generator) * 0.2).to(dtype)
    return weight, torch.randn(2 * INNER, generator=generator).to(dtype)


def _row(dtype: torch.dtype, seed: int) -> UnnormalizedRow:
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, K, generator=generator) * 3).to(dtype)
    residual = torch.randn(1, K, generator=generator).to(dtype)
    weight = (torch.rand(K, generator=generator) + 0.5).to(dtype)
    return UnnormalizedRow(x, residual, weight, 1e-5, False, torch.full_like(x, float("nan")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tiles", [(16, 64, 4, 3), (8, 256, 4, 1)])
def test_the_gemv_makes_act_gate_times_up_as_act_and_mul_does(
    dtype: torch.dtype, activation: str, tiles: tuple[int, int, int, int]
) -> None:
    """16-row programs take 8 gate rows and their up rows (the last half past INNER = 36), 8-row
    ones 4; the row given, or normalized inside (`UnnormalizedRow`, its x + residual written)."""
    weight, bias = _gate_up(dtype)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    want = triton_layers.act_and_mul(gemv(x, weight, bias=bias, tiles=tiles), activation)
    got = gemv(x, weight, bias=bias, tiles=tiles, gated=activation)
    assert got.shape == (1, INNER)
    assert torch.equal(got, want)
    plain, gated = _row(dtype, 6), _row(dtype, 6)
    want = triton_layers.act_and_mul(gemv(plain, weight, bias=bias, tiles=tiles), activation)
    assert torch.equal(gemv(gated, weight, bias=bias, tiles=tiles, gated=activation), want)
    assert torch.equal(gated.residual_out, plain.residual_out)


def test_the_layer_makes_it_only_with_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Linear.forward_gated` runs the gated GEMV where GATED_IN_GEMV and the row takes the
    Triton GEMV (here: a row normalized inside); `gated_inner` falls back to gate_up then
    `act_and_mul` where it does not (the flag off; a CPU row off Hopper)."""
    weight, bias = _gate_up(torch.float32)
    layer = Linear(K, 2 * INNER)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    down = Linear(INNER, 8)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(7))
    assert layer.forward_gated(_row(torch.float32, 8), "silu") is None  # (the flag off)
    want = triton_layers.act_and_mul(layer(x), "silu")
    torch.testing.assert_close(gated_inner(layer, down, x, True, "silu", True), want)
    monkeypatch.setattr(linear, "GATED_IN_GEMV", True)
    assert layer.forward_gated(x, "silu") is None  # (a CPU row: torch's matmul)
    got = layer.forward_gated(_row(torch.float32, 8), "gelu_tanh")
    plain = _row(torch.float32, 8)
    assert got is not None
    assert torch.equal(got, triton_layers.act_and_mul(gemv(plain, weight, bias=bias), "gelu_tanh"))
    row = _row(torch.float32, 9)
    made = gated_inner(layer, down, row, True, "silu", True)
    assert torch.equal(made, triton_layers.act_and_mul(gemv(_row(torch.float32, 9), weight,
                                                            bias=bias), "silu"))  # fmt: skip


def test_an_activation_it_does_not_make_is_refused() -> None:
    weight, _ = _gate_up(torch.float32)
    with pytest.raises(ValueError, match=r"'relu'.*'silu' or 'gelu_tanh'"):
        gemv(torch.ones(1, K), weight, gated="relu")
