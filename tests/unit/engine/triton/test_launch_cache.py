"""CachedKernel under the Triton interpreter (no compiled kernel to replay): every launch goes
through Triton and computes; nothing is kept."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvfleet.engine.layers.launch_cache import CachedKernel, _key_of  # noqa: E402


@triton.jit
def _scale_kernel(x_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * alpha, mask=mask)


def test_interpreted_launches_compute_and_keep_nothing() -> None:
    cached = CachedKernel(_scale_kernel)
    for alpha in (2.0, 2.0, 3.0):
        x = torch.randn(100)
        out = torch.empty_like(x)
        cached[(4,)](x, out, alpha, 100, BLOCK=32)
        assert torch.equal(out, x * alpha)
    assert cached.runners == {}


def test_a_tensor_is_keyed_by_dtype_device_and_alignment_not_address() -> None:
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert _key_of(x) == _key_of(torch.ones(64, dtype=torch.bfloat16))
    assert _key_of(x[8:]) == _key_of(x)  # 16 bytes on
    assert _key_of(x[1:]) != _key_of(x)  # 2 bytes on: Triton compiles another variant
    assert _key_of(x.float()) != _key_of(x)
    assert _key_of(7) == 7
    assert _key_of(None) is None
