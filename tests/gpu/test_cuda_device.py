"""The CUDA device the GPU tests run on: visible, and bf16 matrix products correct on it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_bf16_matmul_matches_float64_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 4096, generator=generator)
    b = torch.randn(4096, 2048, generator=generator)
    reference = a.double() @ b.double()

    out = torch.full((1024, 2048), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.matmul(a.cuda().bfloat16(), b.cuda().bfloat16(), out=out)
    torch.cuda.synchronize()

    result = out.double().cpu()
    assert torch.isfinite(result).all()
    relative_error = (result - reference).norm() / reference.norm()
    assert 1e-4 < relative_error < 1e-2  # bf16 operands: rounding shows, but stays small
