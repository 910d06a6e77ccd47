"""FP8 W8A8 linear layers (engine/layers/quantization/fp8.py) on the CPU, where torch runs the
same scaled GEMM: per-row quantization within e4m3's rounding, the layer equal to its
dequantize-then-multiply reference, within FP8's error of the unquantized layer, and clear
errors for what it cannot take."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.layers.quantization.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    fp8_linear_reference,
    fp8_supported,
    quantize_rows,
)


def test_rows_quantize_within_e4m3_rounding() -> None:
    x = (
        torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
        * torch.logspace(-3, 3, 64)[:, None]
    )
    x[5] = 0.0  # (an all-zero row keeps a finite scale)
    values, scales = quantize_rows(x)
    assert values.dtype == FP8
    assert scales.shape == (64, 1)
    assert torch.isfinite(scales).all()
    assert values.float().abs().amax() <= FP8_MAX
    back = values.float() * scales
    # 3 mantissa bits: half a step is 2^-4 of the value, or of the smallest subnormal step
    bound = x.abs() * 2**-4 + scales * 2**-9
    assert ((back - x).abs() <= bound + 1e-30).all()
    assert torch.equal(back[5], torch.zeros(512))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_equals_its_reference_and_stays_near_the_unquantized_one(
    dtype: torch.dtype, bias: bool
) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 160, bias=bias)
    layer = Fp8Linear.from_linear(linear)
    if bias:
        layer.bias = torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
    x = torch.randn(2, 9, 384).to(dtype)
    out = layer(x)
    assert out.shape == (2, 9, 160)
    assert out.dtype == dtype
    ref = fp8_linear_reference(x.reshape(-1, 384), layer.weight, layer.weight_scale, layer.bias)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.reshape(-1, 160).float(), ref.float(), rtol=tolerance, atol=tolerance
    )
    exact = linear(x.float()).reshape(-1, 160)
    error = (out.reshape(-1, 160).float() - exact).norm() / exact.norm()
    assert error < 0.05  # (e4m3 on both sides of a Gaussian product: ~3.5%)


def test_what_the_layer_cannot_take_is_refused() -> None:
    weight = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"2-D torch\.float8_e4m3fn"):
        Fp8Linear(weight, torch.ones(8, 1), None)
    with pytest.raises(ValueError, match=r"one value per output channel, shape \(8, 1\)"):
        Fp8Linear(weight.to(FP8), torch.ones(8), None)
    reason = fp8_supported(torch.device("cpu"))
    assert reason is not None
    assert "compute capability 8.9" in reason
