"""CachedKernel (engine/layers/launch_cache.py) on the GPU: a launch whose key was seen replays
Triton's compiled kernel with the new tensors; a new dtype, alignment, scalar, constexpr or
grid goes through Triton again; the attention kernels give the same outputs either way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.attention import triton_attention, triton_prompt  # noqa: E402
from kvfleet.engine.attention.torch_backend import TorchAttention  # noqa: E402
from kvfleet.engine.layers.launch_cache import CachedKernel  # noqa: E402


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr, PLUS: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x * alpha + PLUS).to(out_ptr.dtype.element_ty), mask=mask)


class _Counting:
    """The kernel, counting the launches that went through Triton's launcher."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.params, self.calls = kernel, kernel.params, 0

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        self.calls += 1
        return self.kernel[grid]


def test_seen_keys_replay_and_new_ones_go_through_triton() -> None:
    counting = _Counting(_axpb_kernel)
    cached = CachedKernel(counting)

    def axpb(x: Any, alpha: float, plus: int = 1, block: int = 128) -> Any:
        out = torch.full_like(x, float("nan"))
        cached[(triton.cdiv(x.numel(), block),)](x, out, alpha, x.numel(), BLOCK=block, PLUS=plus)
        torch.cuda.synchronize()
        return out

    def expect(x: Any, alpha: float, plus: int = 1) -> Any:
        return (x.float() * alpha + plus).to(x.dtype)

    base = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    for i in range(3):  # fresh tensors, one key: one launch through Triton, two replays
        x = base + i
        assert torch.equal(axpb(x, 2.0), expect(x, 2.0))
    assert (counting.calls, len(cached.runners)) == (1, 1)
    changes = [  # (each made of a source tensor: a second source replays the key)
        (lambda t: t[1:999], 2.0, 1, 128),  # an address off 16 bytes (and another size)
        (lambda t: t.float(), 2.0, 1, 128),  # another dtype
        (lambda t: t, 3.0, 1, 128),  # another scalar
        (lambda t: t, 2, 1, 128),  # the same scalar as an int: another type (i32)
        (lambda t: t, 2.0, 5, 128),  # another constexpr
        (lambda t: t, 2.0, 1, 256),  # another block, and so grid
    ]
    for calls, (made, alpha, plus, block) in enumerate(changes, start=2):
        x = made(base)
        assert torch.equal(axpb(x, alpha, plus, block), expect(x, alpha, plus))
        assert counting.calls == calls
        x = made(base + 1)  # ... and that key now replays
        assert torch.equal(axpb(x, alpha, plus, block), expect(x, alpha, plus))
        assert counting.calls == calls
    assert len(cached.runners) == 1 + len(changes)


def test_layers_of_one_step_replay_the_first_ones_launch(
    attention_case: Callable[..., dict[str, Any]],
) -> None:
    """As between prefill graph pieces: one step's prompt attention in several layers, each
    with its own query and cache, the same sizes: the launches after the first replay it and
    every layer's output is its own, as the torch reference gives it."""
    reference = TorchAttention(32, 8, 128)
    shape = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.bfloat16}
    layers = [
        attention_case([32, 1], [3032, 700], device="cuda", seed=seed, **shape) for seed in range(3)
    ]
    launcher = triton_prompt._PAGED_ATTENTION
    launcher.runners.clear()
    for inputs in layers:
        cache, metadata = inputs["kv_cache"], inputs["metadata"]
        expected = reference.forward(
            inputs["q"].float(), inputs["k"].float(), inputs["v"].float(), cache.float(), metadata
        )
        triton_attention.write_kv_cache(inputs["k"], inputs["v"], cache, metadata.slot_mapping)
        out = torch.full_like(inputs["q"], float("nan"))
        triton_prompt.paged_attention(inputs["q"], cache, metadata, reference.scale, out=out)
        torch.cuda.synchronize()
        relative = float((out.float() - expected).norm() / expected.norm())
        assert relative < 1e-2, relative
    assert len(launcher.runners) == 1
