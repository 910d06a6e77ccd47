"""Fused residual-add + RMSNorm and RoPE kernels against the torch layers (TRITON_INTERPRET on CPU).

float32: within 1e-5; float16: within 2e-3 (one rounding instead of the torch chain's several).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.layers import torch_layers as layers
from kvfleet.engine.layers import triton_layers, triton_rope
from kvfleet.engine.layers.torch_layers import RMSNorm, RotaryEmbedding
from kvfleet.engine.layers.triton_layers import add_rms_norm
from kvfleet.engine.layers.triton_rope import rotary_inplace

TOLERANCES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_norm(
    dtype: torch.dtype, tolerance: float, with_residual: bool, offset: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    residual = torch.randn(7, 96, generator=gen).to(dtype) if with_residual else None
    norm = RMSNorm(96, 1e-5, offset=offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=gen))
        expected, expected_residual = norm(x, residual)
        out, out_residual = add_rms_norm(x, residual, norm.weight, 1e-5, offset)
    assert torch.equal(out_residual, expected_residual)
    assert (out.float() - expected.float()).abs().max() < tolerance


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("head", [32, 24])  # (24: a half of 12 lanes in 16, as Phi-3's 48 in 64)
def test_rotary_in_place(dtype: torch.dtype, tolerance: float, head: int) -> None:
    gen = torch.Generator().manual_seed(1)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rotary = RotaryEmbedding(head, 256, 500000.0, scaling)
    positions = torch.randint(0, 256, (9,), generator=gen)
    qkv = torch.randn(9, 6 * head, generator=gen).to(dtype)  # 4 q heads, 1 k head, 1 v head
    q, k = qkv[:, : 4 * head].view(9, 4, head), qkv[:, 4 * head : 5 * head].view(9, 1, head)
    v_before = qkv[:, 5 * head :].clone()
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    rotary_inplace(q, positions, rotary.cos_cache, rotary.sin_cache)
    rotary_inplace(k, positions, rotary.cos_cache, rotary.sin_cache)
    assert (q.float() - expected_q.float()).abs().max() < tolerance
    assert (k.float() - expected_k.float()).abs().max() < tolerance
    assert torch.equal(qkv[:, 5 * head :], v_before)  # v, in the same buffer, untouched


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_and_mul(dtype: torch.dtype, tolerance: float, activation: str) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * 1500, generator=gen) * 4).to(dtype)  # inner > one block
    expected = layers.act_and_mul(gate_up, activation=activation)
    out = triton_layers.act_and_mul(gate_up, activation)
    assert out.shape == (5, 1500)
    assert (out.float() - expected.float()).abs().max() < tolerance


def test_rotary_layer_rotates_q_and_k_of_one_qkv_buffer_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused layer path: q and k views of one QKV output go through one kernel launch and
    equal the torch chain; separate tensors take one launch each."""
    gen = torch.Generator().manual_seed(3)
    reference = RotaryEmbedding(32, 128, 10000.0)
    fused = RotaryEmbedding(32, 128, 10000.0, fused=True)
    positions = torch.randint(0, 128, (5,), generator=gen)
    qkv = torch.randn(5, 7 * 32, generator=gen)  # 4 q heads, 2 k heads, 1 v head
    launches: list[tuple[int, ...]] = []
    real = triton_rope.rotary_inplace

    def spy(x: torch.Tensor, *args: torch.Tensor) -> None:
        launches.append(tuple(x.shape))
        real(x, *args)

    monkeypatch.setattr(triton_rope, "rotary_inplace", spy)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    q, k = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32)
    expected_q, expected_k = reference(positions, q.clone(), k.clone())
    fused(positions, q, k)
    assert launches == [(5, 6, 32)]
    assert (q - expected_q).abs().max() < 1e-5
    assert (k - expected_k).abs().max() < 1e-5
    separate_q, separate_k = expected_q.clone(), expected_k.clone()
    fused(positions, separate_q, separate_k)
    assert launches[1:] == [(5, 4, 32), (5, 2, 32)]


def test_heads_of_no_power_of_two_take_the_kernels_with_rotary_any_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Phi-3's heads of 96 (here 24): the torch chain without `ROTARY_ANY_HEAD` (on), with it
    the same values through the kernel as heads of a power of two."""
    monkeypatch.setattr(layers, "ROTARY_ANY_HEAD", False)
    assert not RotaryEmbedding(24, 128, 10000.0, fused=True).fused
    assert RotaryEmbedding(32, 128, 10000.0, fused=True).fused
    monkeypatch.setattr(layers, "ROTARY_ANY_HEAD", True)
    fused = RotaryEmbedding(24, 128, 10000.0, fused=True)
    assert fused.fused
    gen = torch.Generator().manual_seed(6)
    positions = torch.randint(0, 128, (5,), generator=gen)
    q, k = torch.randn(5, 4, 24, generator=gen), torch.randn(5, 2, 24, generator=gen)
    expected_q, expected_k = fused(positions, q.clone(), k.clone())  # (on the CPU: torch's)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    fused(positions, q, k)
    assert (q - expected_q).abs().max() < 1e-5
    assert (k - expected_k).abs().max() < 1e-5


BLOCK = 4  # (cache block size of the RoPE + cache write tests)


def _rope_step(
    seed: int, dtype: torch.dtype, scale: float = 1.0, head: int = 32
) -> dict[str, torch.Tensor]:
    """q, k, v (4, 2, 2 heads of `head`) as views of one fused QKV output, with positions,
    slots (past the null block) and the rotary tables, for a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = 7
    cos, sin = RotaryEmbedding(head, 256, 10000.0).caches(torch.device("cpu"))
    qkv = (torch.randn(num_tokens, 8 * head, generator=gen) * scale).to(dtype)
    return {
        "q": qkv[:, : 4 * head].view(-1, 4, head),
        "k": qkv[:, 4 * head : 6 * head].view(-1, 2, head),
        "v": qkv[:, 6 * head :].view(-1, 2, head),
        "positions": torch.randint(0, 256, (num_tokens,), generator=gen),
        "slots": torch.randperm(6 * BLOCK, generator=gen)[:num_tokens] + BLOCK,
        "cos": cos,
        "sin": sin,
    }


def _rotated_and_written(
    step: dict[str, torch.Tensor], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: q and k rotated in place (rotary_inplace), then written with v into a
    fresh cache by write_kv_cache; (q, the cache)."""
    from kvfleet.engine.attention.triton_attention import write_kv_cache

    rotary_inplace(q, step["positions"], step["cos"], step["sin"])
    rotary_inplace(k, step["positions"], step["cos"], step["sin"])
    cache = torch.zeros(2, 8, BLOCK, 2, q.shape[-1], dtype=q.dtype)
    write_kv_cache(k, step["v"], cache, step["slots"])
    return q, cache


def _rotary_and_write_kv(
    step: dict[str, torch.Tensor], qk_norm: triton_rope.QKNorm | None = None
) -> torch.Tensor:
    """The fused kernel on the step (q rotated in place): the cache it fills."""
    from kvfleet.engine.attention.metadata import cache_views

    cache = torch.zeros(2, 8, BLOCK, 2, step["q"].shape[-1], dtype=step["q"].dtype)
    with torch.no_grad():
        triton_rope.rotary_and_write_kv(
            step["q"], step["k"], step["v"], step["positions"], step["cos"], step["sin"],
            *cache_views(cache), step["slots"], None, qk_norm,
        )  # fmt: skip
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head", [32, 24])
def test_rotary_and_kv_write_in_one_kernel_equal_the_two(
    dtype: torch.dtype, head: int, block_layout: str
) -> None:
    """The fused RoPE + cache write gives the bits of rotary_inplace then write_kv_cache (q
    rotated in place; rotated k and v in the cache at each token's slot, blocks token-major or
    head-major; k itself unchanged), heads of a power of two or not (lanes past it masked)."""
    step = _rope_step(4, dtype, head=head)
    expected_q, expected_cache = _rotated_and_written(step, step["q"].clone(), step["k"].clone())
    k_before = step["k"].clone()
    cache = _rotary_and_write_kv(step)
    assert torch.equal(step["q"], expected_q)
    assert torch.equal(cache, expected_cache)
    assert torch.equal(step["k"], k_before)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_over_each_head_of_a_strided_view(
    dtype: torch.dtype, tolerance: float, offset: bool
) -> None:
    """Qwen3's q/k norms (Gemma 3's, times 1 + w): per head, from q's columns of a fused QKV
    output."""
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(6, 4 * 32 + 2 * 2 * 32, generator=gen) * 2).to(dtype)
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    norm = RMSNorm(32, 1e-6, offset=offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32, generator=gen))
        expected, _ = norm(q)
        out = triton_layers.rms_norm_heads(q, norm.weight, 1e-6, offset)
    assert out.is_contiguous()
    assert (out.float() - expected.float()).abs().max() < tolerance


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize(("offset", "head"), [(False, 32), (True, 32), (False, 24)])
def test_q_and_k_norms_fused_into_rope_and_the_kv_write(
    dtype: torch.dtype, tolerance: float, offset: bool, head: int
) -> None:
    """The q/k norms (Qwen3's; Gemma 3's, times 1 + w) inside the RoPE + cache write kernel
    give what rms_norm_heads before it gives: q normalized then rotated in place, k normalized
    and rotated into the cache, k itself unchanged."""
    step = _rope_step(8, dtype, scale=3.0, head=head)
    gen = torch.Generator().manual_seed(9)
    norms = [RMSNorm(head, 1e-6, offset=offset).to(dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.3 * torch.randn(head, generator=gen))
        expected_q, expected_cache = _rotated_and_written(
            step,
            triton_layers.rms_norm_heads(step["q"], norms[0].weight, 1e-6, offset),
            triton_layers.rms_norm_heads(step["k"], norms[1].weight, 1e-6, offset),
        )
    k_before = step["k"].clone()
    cache = _rotary_and_write_kv(
        step, triton_rope.QKNorm(norms[0].weight, norms[1].weight, 1e-6, offset)
    )
    # (the squares summed in two halves, not one row: the last bit may differ, one step of dtype)
    q = step["q"]
    assert (q.float() - expected_q.float()).abs().max() <= tolerance * expected_q.abs().max()
    assert (cache.float() - expected_cache.float()).abs().max() <= tolerance * 4
    assert torch.equal(step["k"], k_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [False, True])
def test_the_norm_quantizes_its_rows_as_the_fp8_layer_would(
    dtype: torch.dtype, offset: bool
) -> None:
    """`add_rms_norm_fp8`: the residual as `add_rms_norm` gives it, each normalized row's scale
    as `quantize_rows` finds it (an all-zero row's the floor), its values as the layer's own
    pass quantizes them (against the Triton pass: the interpreter rounds e4m3 its own way,
    so torch's values are checked on the GPU, tests/gpu/test_fp8_cuda.py)."""
    from kvfleet.engine.layers.quantization.fp8 import FP8, quantize_rows
    from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 96, generator=gen) * 3).to(dtype)
    residual = torch.randn(6, 96, generator=gen).to(dtype)
    x[2], residual[2] = 0.0, 0.0
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    rows, got_residual = triton_layers.add_rms_norm_fp8(x, residual, weight, 1e-5, offset)
    normed, want_residual = add_rms_norm(x, residual, weight, 1e-5, offset)
    values, scales = quantize_rows_triton(normed)
    assert torch.equal(got_residual, want_residual)
    assert rows.dtype == dtype
    assert rows.values.dtype == FP8
    assert rows.shape == (6, 96)
    assert torch.equal(rows.scales, quantize_rows(normed)[1])
    assert torch.equal(rows.scales, scales)
    assert rows.scales[2].item() == pytest.approx(1e-12 / 448.0)
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("inner", [96, 1100])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_silu_and_mul_quantize_their_rows_as_the_fp8_layer_would(
    inner: int, activation: str
) -> None:
    """`act_and_mul_fp8`, a row a program (1,100 columns: past the unquantized kernel's
    1,024-column blocks): each row's scale as `quantize_rows` finds it, its values as the
    layer's own pass quantizes `act_and_mul`'s."""
    from kvfleet.engine.layers.quantization.fp8 import quantize_rows
    from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton

    gen = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(5, 2 * inner, generator=gen) * 2).half()
    rows = triton_layers.act_and_mul_fp8(gate_up, activation)
    inner_rows = triton_layers.act_and_mul(gate_up, activation)
    values, scales = quantize_rows_triton(inner_rows)
    assert rows.dtype == torch.float16
    assert rows.shape == (5, inner)
    assert torch.equal(rows.scales, quantize_rows(inner_rows)[1])
    assert torch.equal(rows.scales, scales)
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
