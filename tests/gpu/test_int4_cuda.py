"""The Triton W4A16 kernels on the GPU at Llama-3-8B's shapes against their dequantize-then-
multiply reference (bf16 activations; group 128; act-order and a bias too). Timed by
bench/int4_gemm.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.layers.quantization.int4 import (  # noqa: E402
    int4_linear_reference,
    quantize_rtn,
)
from kvfleet.engine.layers.quantization.triton_int4 import w4a16_matmul  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_matches_its_reference(n: int, k: int, act_order: bool) -> None:
    weights = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, torch.bfloat16)
    if act_order:
        weights.perm = torch.randperm(k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 1, 7, 7, 32, 64, 512):  # (twice: the split-K counters reset)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = w4a16_matmul(x, weights, bias).float()
        want = int4_linear_reference(x.float(), weights, bias.float())
        # (bf16 dequantized weights in the tensor-core path and a bf16 output: bf16's rounding)
        assert (got - want).norm() / want.norm() < 1e-2, m
