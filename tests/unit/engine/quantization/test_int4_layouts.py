"""AWQ and GPTQ checkpoints' packed tensors, written here as AutoAWQ and AutoGPTQ pack them
(their loops, over plain integers), read into kvfleet's INT4 layout: the dequantized weights
are exactly (q - zero) x scale, act-order GPTQ included, and the reference layer computes
x @ W with them."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.layers.quantization.packed import from_awq, from_gptq, packed_linear_reference

K, N = 256, 64


def _gptq_pack_rows(intweight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AutoGPTQ's qweight packing: 32 / bits input rows per int32 row, row j at bits
    bits (j % (32 / bits))."""
    per = 32 // bits
    packed = torch.zeros(intweight.shape[0] // per, intweight.shape[1], dtype=torch.int64)
    for row in range(packed.shape[0]):
        for j in range(per):
            packed[row] |= intweight[row * per + j].long() << (bits * j)
    return _as_int32(packed)


def _pack_columns(values: torch.Tensor, order: list[int], bits: int = 4) -> torch.Tensor:
    """qzeros (GPTQ, order 0..7, or 0..3 at 8 bits) and AWQ's qweight/qzeros (order 0, 2, 4,
    6, 1, 3, 5, 7)."""
    per = 32 // bits
    packed = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for col in range(packed.shape[1]):
        for i in range(per):
            packed[:, col] |= values[:, col * per + order[i]].long() << (bits * i)
    return _as_int32(packed)


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns into int32, as numpy's uint32 arrays are saved as int32."""
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _random(group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=generator)
    zeros = torch.randint(0, 16, (K // group, N), generator=generator)
    scales = (torch.rand(K // group, N, generator=generator) * 0.02 + 0.001).half()
    return q, zeros, scales


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_weights_dequantize_exactly(group: int, v2: bool) -> None:
    q, zeros, scales = _random(group, group)
    if not v2:  # (the original format stores zero - 1 in 4 bits: a zero of 0 cannot be held)
        zeros = zeros.clamp_min(1)
    stored_zeros = zeros if v2 else zeros - 1
    weights = from_gptq(
        _gptq_pack_rows(q),
        _pack_columns(stored_zeros, list(range(8))),
        scales,
        torch.arange(K) // group,
        group,
        zero_offset=0 if v2 else 1,
    )
    assert weights.perm is None
    want = (q - zeros.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(
        group, 0
    )
    assert torch.equal(weights.dequantize(), want)


def test_gptq_act_order_sorts_the_input_by_group() -> None:
    group = 32
    q, zeros, scales = _random(group, 9)
    zeros = zeros.clamp_min(1)  # (the v1 format's zeros)
    order = torch.randperm(K, generator=torch.Generator().manual_seed(4))
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // group).to(torch.int32)  # (act-order: groups by rank)
    weights = from_gptq(
        _gptq_pack_rows(q),
        _pack_columns(zeros - 1, list(range(8))),
        scales,
        g_idx,
        group,
    )
    assert weights.perm is not None
    w = (q - zeros[g_idx.long()]).float() * scales.float()[g_idx.long()]  # [K, N], original order
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(packed_linear_reference(x, weights), x @ w, rtol=1e-5, atol=1e-5)
    uneven = g_idx.clone()
    uneven[0] = (uneven[0] + 1) % (K // group)
    with pytest.raises(ValueError, match=r"exactly 32 input rows"):
        from_gptq(_gptq_pack_rows(q), _pack_columns(zeros - 1, list(range(8))), scales,
                  uneven, group)  # fmt: skip


@pytest.mark.parametrize("group", [64, 128])
def test_awq_weights_dequantize_exactly(group: int) -> None:
    q, zeros, scales = _random(group, 7)
    awq_order = [0, 2, 4, 6, 1, 3, 5, 7]
    weights = from_awq(_pack_columns(q, awq_order), _pack_columns(zeros, awq_order), scales, group)
    want = (q - zeros.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(
        group, 0
    )
    assert torch.equal(weights.dequantize(), want)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(packed_linear_reference(x, weights), x @ want, rtol=1e-5, atol=1e-5)


def _kernels_equal_the_reference(
    weights: object, rows: int, split: str, tiles: dict[str, tuple[tuple[int, ...], ...]]
) -> None:
    """The one-row kernel (rows 1) or the slice GEMM with `tiles[split]` (GEMV (BLOCK_N,
    BLOCK_K, STEPS, warps), GEMM (BLOCK_M, BLOCK_N, R, STEPS, warps)), each twice (the split
    counters reset), then the dispatcher and the dequantizing path for 40 rows, against the
    reference with a bias (float32, Triton's interpreter)."""
    from kvfleet.engine.layers.quantization.packed import PackedWeights
    from kvfleet.engine.layers.quantization.triton_packed import (
        gemv_plan,
        packed_gemm,
        packed_gemv,
        packed_matmul,
        shared_workspace,
    )

    assert isinstance(weights, PackedWeights)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(11))
    want = packed_linear_reference(x, weights, bias)
    gemv_tiles, gemm_tiles = tiles[split]
    for _ in range(2):
        if rows == 1:
            got = packed_gemv(x, weights, bias, gemv_tiles)
            split_count = gemv_plan(N, K, weights.group_size, gemv_tiles)[3]
            assert split_count == {"one": 1, "uneven": 3, "fine": 16}[split]
        else:
            got = packed_gemm(x, weights, bias, gemm_tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert not shared_workspace(x.device, 0, 0).counters.any()
    torch.testing.assert_close(packed_matmul(x, weights, bias), want, rtol=1e-5, atol=1e-4)
    big = torch.randn(40, K, generator=torch.Generator().manual_seed(40))  # (dequantizing)
    torch.testing.assert_close(
        packed_matmul(big, weights, bias), packed_linear_reference(big, weights, bias),
        rtol=1e-5, atol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("split", ["one", "uneven", "fine"])
def test_the_triton_w4a16_kernels_equal_the_reference(
    act_order: bool, rows: int, split: str
) -> None:
    """In Triton's interpreter on the CPU (integer unpacking is exact there), float32: the
    one-row kernel and the slice GEMM unsplit, split unevenly (the last program partly past
    K, masked) and finely; the dequantizing path for more rows; act-order and a bias."""
    group = 32
    q, zeros, scales = _random(group, 3)
    g_idx = torch.arange(K) // group
    if act_order:
        order = torch.randperm(K, generator=torch.Generator().manual_seed(8))
        g_idx = torch.empty(K, dtype=torch.int64)
        g_idx[order] = torch.arange(K) // group
    zeros = zeros.clamp_min(1)
    weights = from_gptq(
        _gptq_pack_rows(q), _pack_columns(zeros - 1, list(range(8))), scales.float(),
        g_idx.to(torch.int32), group,
    )  # fmt: skip
    # (K = 256: 32 words)
    tiles = {
        "one": ((32, 32, 8, 4), (16, 32, 16, 2, 4)),
        "uneven": ((16, 64, 3, 2), (16, 16, 16, 3, 4)),  # (3 x 32 inputs; 3 x 16 words)
        "fine": ((64, 16, 1, 4), (16, 32, 16, 1, 4)),
    }
    _kernels_equal_the_reference(weights, rows, split, tiles)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("split", ["one", "uneven", "fine"])
def test_the_triton_kernels_take_8_bit_words(rows: int, split: str) -> None:
    """The same kernels over 8-bit values (four to a word: GGUF's Q8_0 layers); every byte
    value 0..255 occurs. The default plan for groups of 32 takes 8 steps of 32 inputs."""
    from kvfleet.engine.layers.quantization.packed import PackedWeights, pack_rows, unpack_rows
    from kvfleet.engine.layers.quantization.triton_packed import gemv_plan

    group = 32
    generator = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (K, N), generator=generator)
    q[:, 0] = torch.arange(K)  # (0..255 in one column)
    zeros = torch.randint(0, 256, (K // group, N), generator=generator).float()
    scales = torch.rand(K // group, N, generator=generator) * 0.002 + 1e-4
    packed = pack_rows(q, bits=8)
    assert packed.shape == (K // 4, N)
    assert torch.equal(unpack_rows(packed, bits=8), q.int())
    weights = PackedWeights(packed, scales, zeros, group, bits=8)
    per_input = (zeros.repeat_interleave(group, 0), scales.repeat_interleave(group, 0))
    assert torch.equal(weights.dequantize(), (q - per_input[0]) * per_input[1])
    assert gemv_plan(N, K, group)[1:4] == (32, 8, 1)
    # (K = 256: 64 words of four)
    tiles = {
        "one": ((32, 32, 8, 4), (16, 32, 32, 2, 4)),
        "uneven": ((16, 32, 3, 2), (16, 16, 16, 3, 4)),  # (3 x 32 inputs; 3 x 16 words)
        "fine": ((64, 16, 1, 4), (16, 32, 16, 1, 4)),
    }
    _kernels_equal_the_reference(weights, rows, split, tiles)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_one_row_kernel_keeps_activations_far_apart_in_size(bits: int) -> None:
    """Its values are read as subnormals and the activations scaled by 2^(85 - b) (b: the
    value's bit): inputs from 2^-40 to 2^40 in one row (neighbours 4x apart), finite and
    against the float64 reference, relative to each output's sum of |x w|."""
    from kvfleet.engine.layers.quantization.packed import PackedWeights, pack_rows
    from kvfleet.engine.layers.quantization.triton_packed import packed_gemv

    generator = torch.Generator().manual_seed(21)
    q = torch.randint(0, 1 << bits, (K, N), generator=generator)
    zeros = torch.randint(0, 1 << bits, (K // 32, N), generator=generator).float()
    scales = torch.rand(K // 32, N, generator=generator) * 0.02 + 0.001
    weights = PackedWeights(pack_rows(q, bits=bits), scales, zeros, 32, bits=bits)
    exponents = (torch.arange(K) % 41 - 20) * 2.0  # (-40 .. 40, every input's own)
    signs = torch.randint(0, 2, (K,), generator=generator) * 2 - 1
    x = (signs * 2.0**exponents).float()[None, :]
    w = weights.dequantize().double()
    want = x.double() @ w
    got = packed_gemv(x, weights, None, (32, 32, 8, 4)).double()
    scale = x.double().abs() @ w.abs()
    assert torch.isfinite(got).all()
    assert ((got - want).abs() / scale).max() < 1e-6


def test_round_to_nearest_keeps_each_weight_within_half_a_step() -> None:
    from kvfleet.engine.layers.quantization.packed import quantize_rtn

    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    weights = quantize_rtn(weight, 64, torch.float32)
    step = weights.scales.repeat_interleave(64, dim=0)
    assert ((weights.dequantize() - weight.t()).abs() <= step / 2 + 1e-6).all()
    assert weights.zeros.min() >= 0
    assert weights.zeros.max() <= 15


def test_the_one_row_plan_takes_narrower_blocks_for_large_layers() -> None:
    """Llama-3-8B's gate_up and down (from 2^25 weights) take 32-wide blocks of 4 steps on 2
    warps, qkv and o the 64-wide blocks of 2 steps; groups of 32 keep the inputs a program."""
    from kvfleet.engine.layers.quantization.triton_packed import gemv_plan

    assert gemv_plan(28672, 4096, 128) == (32, 128, 4, 8, 2)
    assert gemv_plan(4096, 14336, 128) == (32, 128, 4, 28, 2)
    assert gemv_plan(6144, 4096, 128) == (64, 128, 2, 16, 4)
    assert gemv_plan(4096, 4096, 128) == (64, 128, 2, 16, 4)
    assert gemv_plan(28672, 4096, 32) == (32, 32, 16, 8, 2)
