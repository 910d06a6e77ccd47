"""FP8 linear layers on the GPU at Llama-3-8B's shapes: the one-pass Triton row quantization
gives torch's exact values and scales, and the layer matches its dequantize-then-multiply
reference. (The Triton interpreter mis-rounds e4m3 on the CPU: this is checked here.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.layers.quantization.fp8 import (  # noqa: E402
    Fp8Linear,
    fp8_linear_reference,
    fp8_supported,
    quantize_rows,
)
from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("cols", [4096, 14336, 1000])
def test_triton_row_quantization_equals_torch(rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :5] = torch.tensor([448.0, -1000.0, 1e-6, 0.0, 2.5])
    values, scales = quantize_rows_triton(x)
    want_values, want_scales = quantize_rows(x)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0)
    assert torch.equal(values.float(), want_values.float())


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_layer_matches_its_reference_at_llama_shapes(n: int, k: int) -> None:
    assert fp8_supported(torch.device("cuda")) is None
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    for m in (1, 64, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = layer(x).float()
        ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, None).float()
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
        exact = torch.nn.functional.linear(x.float(), linear.weight.float())
        assert (out - exact).norm() / exact.norm() < 0.05
