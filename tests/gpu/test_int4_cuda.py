"""The Triton W4A16 GEMM on the GPU at Llama-3-8B's shapes against its dequantize-then-multiply
reference (bf16 activations; group 128; act-order too). Timed by bench/int4_gemm.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.layers.quantization.int4 import (  # noqa: E402
    Int4Weights,
    int4_linear_reference,
    pack_rows,
)
from kvfleet.engine.layers.quantization.triton_int4 import w4a16_matmul  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N)


def _weights(k: int, n: int, group: int, act_order: bool) -> Int4Weights:
    q = torch.randint(0, 16, (k, n), device="cuda")
    scales = (torch.rand(k // group, n, device="cuda") * 0.01 + 0.001).bfloat16()
    zeros = torch.randint(0, 16, (k // group, n), device="cuda").bfloat16()
    perm = torch.randperm(k, device="cuda") if act_order else None
    return Int4Weights(pack_rows(q), scales, zeros, group, perm)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_matches_its_reference(k: int, n: int, act_order: bool) -> None:
    weights = _weights(k, n, 128, act_order)
    for m in (1, 7, 64, 512):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = w4a16_matmul(x, weights).float()
        want = int4_linear_reference(x.float(), weights)
        # (bf16 dequantized weights and a bf16 output: bf16's rounding)
        assert (got - want).norm() / want.norm() < 1e-2
