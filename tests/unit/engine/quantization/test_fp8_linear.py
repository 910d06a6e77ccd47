"""FP8 W8A8 linear layers (engine/layers/quantization/fp8.py) on the CPU, where torch runs the
same scaled GEMM: per-row quantization within e4m3's rounding, the layer equal to its
dequantize-then-multiply reference, within FP8's error of the unquantized layer, and clear
errors for what it cannot take."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfleet.engine.layers.quantization.block_fp8 import (
    BlockFp8Linear,
    block_fp8_reference,
    dequantize_blocks,
)
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
    layer = Fp8Linear(16, 8, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"'w' is torch\.float32; an FP8 checkpoint stores"):
        layer.load_part("weight", torch.zeros(8, 16), None, "w")
    with pytest.raises(ValueError, match=r"'w' has shape \(8, 15\), the model expects \(8, 16\)"):
        layer.load_part("weight", torch.zeros(8, 15, dtype=FP8), None, "w")
    with pytest.raises(ValueError, match=r"'s' has shape \(4, 1\), the model expects \(8, 1\)"):
        layer.load_part("weight_scale", torch.ones(4), None, "s")
    with pytest.raises(ValueError, match=r"'x' has no place in a Fp8Linear layer"):
        layer.load_part("input_scale", torch.ones(1), None, "x")  # (dynamic: no input scale)
    with pytest.raises(ValueError, match=r"input features divisible by the block's 128 columns"):
        BlockFp8Linear(200, 128, bias=False, dtype=torch.float32, block=(128, 128))
    block = BlockFp8Linear(128, 256, bias=False, dtype=torch.float32, block=(128, 128))
    with pytest.raises(ValueError, match=r"starts at row 64 of a fused layer, not on a 128-row"):
        block.load_part("weight_scale_inv", torch.ones(1, 1), (64, 64), "k")
    reason = fp8_supported(torch.device("cpu"))
    assert reason is not None
    assert "compute capability 8.9" in reason


def test_block_layer_equals_its_reference_and_stays_near_the_unquantized_one() -> None:
    torch.manual_seed(0)
    weight = torch.randn(320, 256) * 0.05
    layer = BlockFp8Linear(256, 320, bias=False, dtype=torch.float32, block=(128, 128), online=True)
    layer.load_part("weight", weight, None, "w")
    x = torch.randn(7, 256)
    out = layer(x)
    ref = block_fp8_reference(x, layer.weight, layer.weight_scale, (128, 128), None)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # (on the CPU the layer is the reference)
    exact = x @ weight.t()
    assert (out - exact).norm() / exact.norm() < 0.05
    # each 128 x 128 tile (and the 64-row remainder) scaled by its own largest magnitude
    back = dequantize_blocks(layer.weight, layer.weight_scale, (128, 128))
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + 1e-4).all()
    assert layer.weight_scale.shape == (3, 2)
    torch.testing.assert_close(
        layer.weight_scale[2, 1], weight[256:, 128:].abs().amax() / FP8_MAX, rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("static", [False, True])
def test_the_fused_gemv_equals_the_reference_in_the_interpreter(
    static: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row quantized inside (W8A8, `triton_gemv.FP8_BF16_ROW` off). Triton's interpreter
    rounds e4m3 casts its own way, so the activations are chosen on e4m3's grid (their row
    maximum, in the third of four tiles, at 448 times the scale): the kernel's quantization
    then rounds nothing, and what is checked is the rest of it, to float32's summation noise."""
    from kvfleet.engine.layers import triton_gemv
    from kvfleet.engine.layers.triton_gemv import gemv

    monkeypatch.setattr(triton_gemv, "FP8_BF16_ROW", False)

    generator = torch.Generator().manual_seed(1)
    grid = (torch.randn(1, 200, generator=generator) * 60).clamp(-440, 440)
    grid = grid.to(FP8).float()
    grid[:, 150] = 448.0
    x = grid * 0.25
    weight, scale = quantize_rows(torch.randn(40, 200, generator=generator) * 0.1)
    bias = torch.randn(40, generator=generator)
    x_scale = torch.tensor(0.25) if static else None
    out = gemv(x, weight, scale, bias, x_scale, tiles=(16, 64, 4, 3))
    want = grid * 0.25 @ (weight.float() * scale).t() + bias
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [40, 130])
def test_the_tensor_core_gemv_equals_the_reference_in_the_interpreter(
    static: bool, rows: int
) -> None:
    """`fp8_gemv_mma`: e4m3 activations on e4m3's grid as above, rows past a 64-row block, K
    (200) cut into tiles of 64 whose last is part-filled and split across programs whose
    parts the last to arrive adds (with the bias), the counters left at zero."""
    from kvfleet.engine.layers.quantization.triton_packed import shared_workspace
    from kvfleet.engine.layers.triton_gemv import fp8_gemv_mma, fp8_mma_plan

    generator = torch.Generator().manual_seed(2)
    grid = (torch.randn(1, 200, generator=generator) * 60).clamp(-440, 440)
    grid = grid.to(FP8).float()
    grid[:, 150] = 448.0
    weight, scale = quantize_rows(torch.randn(rows, 200, generator=generator) * 0.1)
    bias = torch.randn(rows, generator=generator)
    x_scale = torch.tensor(0.25) if static else None
    tiles = (64, 64, 4)
    assert fp8_mma_plan(rows, 200, torch.device("cpu"), tiles)[3] > 1  # (split)
    out = fp8_gemv_mma(grid * 0.25, weight, scale, bias, x_scale, tiles)
    want = grid * 0.25 @ (weight.float() * scale).t() + bias
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert not shared_workspace(torch.device("cpu"), 0, 0).counters.any()


@pytest.mark.parametrize(("m", "static", "with_bias"), [(2, False, True), (23, False, False),
                                                       (40, True, True)])  # fmt: skip
def test_the_tensor_core_gemv_over_quantized_rows_equals_the_reference_in_the_interpreter(
    m: int, static: bool, with_bias: bool
) -> None:
    """`fp8_rows_mma`: e4m3 rows with their scales (or one static scale expanded) as the
    product's 16/32/64 columns, the padding columns past M never written; weight rows past a
    64-row block, K (200) in part-filled tiles split across programs whose parts the last to
    arrive adds (with the bias, one a weight row), the counters left at zero."""
    from kvfleet.engine.layers.quantization.triton_packed import shared_workspace
    from kvfleet.engine.layers.triton_gemv import fp8_mma_plan, fp8_rows_mma

    generator = torch.Generator().manual_seed(m)
    x_q, x_scale = quantize_rows(torch.randn(m, 200, generator=generator))
    if static:
        x_scale = torch.tensor([[0.03]]).expand(m, 1)
    weight, scale = quantize_rows(torch.randn(130, 200, generator=generator) * 0.1)
    bias = torch.randn(130, generator=generator) if with_bias else None
    tiles = (64, 64, 4)
    assert fp8_mma_plan(130, 200, torch.device("cpu"), tiles, rows=m)[3] > 1  # (split)
    out = fp8_rows_mma(x_q, x_scale, weight, scale, bias, torch.float32, tiles)
    want = (x_q.float() * x_scale) @ (weight.float() * scale).t()
    if bias is not None:
        want = want + bias
    assert out.shape == (m, 130)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert not shared_workspace(torch.device("cpu"), 0, 0).counters.any()


def test_the_triton_gemm_widens_its_column_tiles_only_where_every_sm_keeps_one() -> None:
    """Up to 64 rows, 128-wide column tiles where they still give each SM a program (the CPU
    stands in for 4 SMs), else 64-wide; more rows keep their tiles."""
    from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemm_tiles

    cpu = torch.device("cpu")
    assert fp8_gemm_tiles(16, 512, cpu)[:2] == (64, 128)
    assert fp8_gemm_tiles(64, 384, cpu)[:2] == (64, 64)
    assert fp8_gemm_tiles(65, 4096, cpu)[:2] == (128, 64)


@pytest.mark.parametrize("tiles", [(16, 16, 32, 4, 1), (32, 64, 64, 4, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_the_triton_gemm_equals_the_reference_in_the_interpreter(
    tiles: tuple[int, int, int, int, int], with_bias: bool, static: bool, split: int
) -> None:
    """`fp8_gemm` on e4m3 rows already quantized (the interpreter's own e4m3 rounding stays
    out: the inputs are e4m3 already): rows and columns past their tiles, K (200) past its
    tiles, both scales and the bias in the epilogue, float32 out as the reference's; a static
    input scale arrives as one value expanded over the rows, as `Fp8Linear` passes it. Split
    in 3: K's 7 tiles of 32 cut 3 / 3 / 1, its 4 of 64 cut 2 / 2 / none (a part with no
    tiles still arrives), twice over (the counters reset)."""
    from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemm

    generator = torch.Generator().manual_seed(7)
    x_q, x_scale = quantize_rows(torch.randn(37, 200, generator=generator))
    if static:
        x_scale = torch.tensor([[0.25]]).expand(37, 1)
    weight, scale = quantize_rows(torch.randn(70, 200, generator=generator) * 0.1)
    bias = torch.randn(70, generator=generator) if with_bias else None
    want = (x_q.float() * x_scale) @ (weight.float() * scale).t()
    if bias is not None:
        want = want + bias
    for _ in range(2 if split > 1 else 1):
        out = fp8_gemm(x_q, x_scale, weight, scale, bias, torch.float32, tiles, split)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_the_tensor_core_gemv_over_rows_is_taken_where_it_measured_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an H200's 132 SMs: at 2-16 rows Llama-3-8B's qkv, o and down cut K over programs
    (the Triton GEMM gives them 64-96 programs); gate_up's 448 row blocks do not, and go to
    the GEMM; at 17-32 rows only down's long K."""
    from kvfleet.engine.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    for rows in (2, 16):
        assert triton_gemv.rows_mma_pays(*qkv, cuda, rows)
        assert triton_gemv.rows_mma_pays(*o, cuda, rows)
        assert triton_gemv.rows_mma_pays(*down, cuda, rows)
        assert not triton_gemv.rows_mma_pays(*gate_up, cuda, rows)
    for rows in (17, 32):
        assert triton_gemv.rows_mma_pays(*down, cuda, rows)
        for shape in (qkv, o, gate_up):
            assert not triton_gemv.rows_mma_pays(*shape, cuda, rows)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_the_gemvs_normalize_their_row_as_the_norm_kernel_does(
    static: bool, tensor_cores: bool
) -> None:
    """An `UnnormalizedRow` (x + residual before its RMSNorm) through either e4m3 GEMV gives, bit
    for bit, that GEMV of `triton_layers.add_rms_norm`'s output, its largest magnitude (for the
    row's scale) taken after the norm; the first program writes x + residual (the tensor-core
    GEMV with K split across programs); the layer hands such a row to its GEMV."""
    from kvfleet.engine.layers import triton_layers
    from kvfleet.engine.layers.linear import UnnormalizedRow
    from kvfleet.engine.layers.triton_gemv import fp8_gemv_mma, fp8_mma_plan, gemv

    generator = torch.Generator().manual_seed(11)
    x = torch.randn(1, 200, generator=generator) * 3
    x[0, 17] = 40.0  # (the largest before the norm, not after: its weight is small)
    residual = torch.randn(1, 200, generator=generator)
    norm_weight = torch.rand(200, generator=generator) * 2 + 0.1
    norm_weight[17] = 0.01
    row = UnnormalizedRow(x, residual, norm_weight, 1e-5, False, torch.full_like(x, float("nan")))
    weight, scale = quantize_rows(torch.randn(130, 200, generator=generator) * 0.1)
    bias = torch.randn(130, generator=generator)
    x_scale = torch.tensor(0.01) if static else None
    normed, summed = triton_layers.add_rms_norm(x, residual, norm_weight, 1e-5)
    if tensor_cores:
        tiles = (64, 64, 4)
        assert fp8_mma_plan(130, 200, torch.device("cpu"), tiles)[3] > 1  # (split)
        want = fp8_gemv_mma(normed, weight, scale, bias, x_scale, tiles)
        got = fp8_gemv_mma(row, weight, scale, bias, x_scale, tiles)
    else:
        want = gemv(normed, weight, scale, bias, x_scale, tiles=(16, 64, 4, 3))
        got = gemv(row, weight, scale, bias, x_scale, tiles=(16, 64, 4, 3))
    assert torch.equal(got, want)
    assert torch.equal(row.residual_out, summed)
    layer = Fp8Linear(200, 130, bias=True, dtype=torch.float32, static_input=static)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(scale)
        layer.bias.copy_(bias)
        if x_scale is not None and layer.input_scale is not None:
            layer.input_scale.fill_(x_scale)
    assert torch.equal(layer(row), gemv(normed, weight, scale, bias, x_scale))


@pytest.mark.parametrize(("split", "qk_norm"), [(1, False), (4, False), (4, True)])
def test_the_tensor_core_gemv_rotates_and_writes_the_cache_as_the_rope_kernel_does(
    split: int, qk_norm: bool, block_layout: str
) -> None:
    """`fp8_gemv_mma` given a `RotaryWrite` (4 q heads, 2 KV heads of 128, two row blocks a
    head; K whole or split across programs; each head of q and k maybe RMS-normalized): the
    bits of the same GEMV then `rotary_and_write_kv`, through the last program of each row
    block (and of each head), every counter back at zero."""
    from kvfleet.engine.attention.metadata import cache_views
    from kvfleet.engine.layers.quantization.triton_packed import shared_workspace
    from kvfleet.engine.layers.torch_layers import RotaryEmbedding
    from kvfleet.engine.layers.triton_gemv import fp8_gemv_mma, fp8_mma_plan
    from kvfleet.engine.layers.triton_rope import QKNorm, RotaryWrite, rotary_and_write_kv

    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(1, 200, generator=generator) * 3).to(torch.float16)
    weight, scale = quantize_rows(torch.randn(8 * 128, 200, generator=generator) * 0.1)
    bias = torch.randn(8 * 128, generator=generator).to(torch.float16)
    cos, sin = RotaryEmbedding(128, 512, 10000.0).caches(torch.device("cpu"))
    positions, slots = torch.tensor([301]), torch.tensor([9])
    norm = None
    if qk_norm:
        weights = (torch.rand(2, 128, generator=generator) * 0.5 + 0.75).to(torch.float16)
        norm = QKNorm(weights[0], weights[1], 1e-6, False)
    tiles = (64, 64, 4)
    assert fp8_mma_plan(8 * 128, 200, torch.device("cpu"), tiles, split)[3] == split
    expected_cache = torch.full((2, 6, 4, 2, 128), 7.0, dtype=torch.float16)
    qkv = fp8_gemv_mma(x, weight, scale, bias, None, tiles, split)
    q, k, v = (part.view(1, -1, 128) for part in qkv.split([512, 256, 256], dim=1))
    rotary_and_write_kv(q, k, v, positions, cos, sin, *cache_views(expected_cache), slots,
                        None, norm)  # fmt: skip
    cache = torch.full_like(expected_cache, 7.0)
    target = RotaryWrite(positions, cos, sin, *cache_views(cache), slots, None, 4, 2, norm)
    out = fp8_gemv_mma(x, weight, scale, bias, None, tiles, split, rotary=target)
    assert torch.equal(out[:, :512], qkv[:, :512])
    assert torch.equal(cache, expected_cache)
    assert not shared_workspace(torch.device("cpu"), 0, 0).counters.any()


@pytest.mark.parametrize("static", [False, True])
def test_the_gemv_times_the_row_as_it_is_equals_the_dequantized_reference(
    static: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`triton_gemv.FP8_BF16_ROW` (W8A16 at one row): the row is not quantized (a static input
    scale not applied either), the products exact, to float32's summation noise of the
    dequantized reference; the row quantized first (W8A8) is further off than that."""
    from kvfleet.engine.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "FP8_BF16_ROW", True)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, 200, generator=generator)
    weight, scale = quantize_rows(torch.randn(40, 200, generator=generator) * 0.1)
    bias = torch.randn(40, generator=generator)
    x_scale = torch.tensor(0.25) if static else None
    out = triton_gemv.gemv(x, weight, scale, bias, x_scale, tiles=(16, 64, 4, 3))
    want = x @ (weight.float() * scale).t() + bias
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    x_q, x_s = quantize_rows(x)
    assert (x_q.float() * x_s @ (weight.float() * scale).t() + bias - want).abs().max() > 1e-3


def test_the_e4m3_layer_merges_split_rows_as_read_where_it_takes_the_row_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode attention's splits (`SplitRows`) into the e4m3 layer's one-row GEMV: the layer
    merged row's output, splits holding no keys out; only with FP8_BF16_ROW, whole heads of a
    power of two, on CUDA."""
    from kvfleet.engine.layers import triton_gemv
    from kvfleet.engine.layers.linear import SplitRows

    generator = torch.Generator().manual_seed(4)
    layer = Fp8Linear.from_linear(torch.nn.Linear(128, 48, bias=True))
    parts = torch.randn(3, 128, generator=generator)
    lse = torch.randn(4, 3, generator=generator) * 3
    lse[1, 2] = lse[3, 0] = float("-inf")
    rows = SplitRows(parts, lse)
    weights = torch.softmax(lse, dim=1)  # [heads, splits]
    merged = torch.einsum("hs,shd->hd", weights, parts.view(3, 4, 32)).reshape(1, 128)
    monkeypatch.setattr(triton_gemv, "FP8_BF16_ROW", True)
    want = merged @ (layer.weight.float() * layer.weight_scale).t() + layer.bias
    torch.testing.assert_close(layer(rows), want, rtol=1e-5, atol=1e-5)
    cuda_row = torch.empty(1, 128, device="meta")
    assert not layer.takes_split_rows(merged, 32)  # (the CPU)
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert layer.takes_split_rows(cuda_row, 32)
        assert not layer.takes_split_rows(cuda_row, 96)
        patch.setattr(triton_gemv, "FP8_BF16_ROW", False)
        assert not layer.takes_split_rows(cuda_row, 32)


def test_e4m3_rows_as_they_are_take_the_bf16_plans(
    monkeypatch: pytest.MonkeyPatch, kernel_launches: Any
) -> None:
    """With FP8_BF16_ROW the e4m3 layer's one-row GEMV runs the bf16 weights' plan for its
    shape, where the row quantized first runs the e4m3 plan (the CUDA-core kernel's, here); qkv
    layers rotate in its row blocks."""
    from kvfleet.engine.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_gemv, "FP8_TENSOR_CORES", False)
    launches = kernel_launches(triton_gemv, "_gemv_kernel")
    weight, scale = quantize_rows(torch.randn(64, 4096) * 0.1)
    x = torch.randn(1, 4096)
    bf16_plan = triton_gemv.one_row_plan(64, 4096, 2, x.device)  # (8 rows, 2,048 inputs)
    for as_is in (False, True):
        monkeypatch.setattr(triton_gemv, "FP8_BF16_ROW", as_is)
        triton_gemv.gemv(x, weight, scale)
    (_, quantized), (_, scaled) = launches
    assert quantized["BLOCK_K"] == triton_gemv.one_row_plan(64, 4096, 1, x.device)[1]
    assert (quantized["QUANTIZE"], quantized["SCALED"]) == (True, False)
    assert (scaled["BLOCK_N"], scaled["BLOCK_K"], scaled["num_warps"]) == bf16_plan[:3]
    assert (scaled["QUANTIZE"], scaled["SCALED"]) == (False, True)
    e4m3 = torch.empty(6144, 4096, dtype=FP8, device="meta")
    assert triton_gemv.takes_rotary(e4m3, 8)
    assert not triton_gemv.takes_rotary(e4m3, 4)


def test_paired_e4m3_rows_sum_products_in_pairs_over_twice_the_inputs(
    monkeypatch: pytest.MonkeyPatch, kernel_launches: Any
) -> None:
    """A shape `PAIRED_E4M3_ROWS` names: the bf16 plan with BLOCK_K doubled, each two products
    summed before the accumulator (GROUP 2), to float32's summation noise of the dequantized
    reference, as the unpaired GEMV is; other shapes as before."""
    from kvfleet.engine.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_gemv, "FP8_BF16_ROW", True)
    launches = kernel_launches(triton_gemv, "_gemv_kernel")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4096, generator=generator)
    weight, scale = quantize_rows(torch.randn(64, 4096, generator=generator) * 0.1)
    want = x @ (weight.float() * scale).t()
    outs = []
    for paired in (frozenset(), frozenset({(64, 4096)})):
        monkeypatch.setattr(triton_gemv, "PAIRED_E4M3_ROWS", paired)
        outs.append(triton_gemv.gemv(x, weight, scale))
        torch.testing.assert_close(outs[-1], want, rtol=1e-5, atol=1e-5)
    (_, plain), (_, paired_launch) = launches
    assert (plain["GROUP"], paired_launch["GROUP"]) == (1, 2)
    block_k = triton_gemv.one_row_plan(64, 4096, 2, x.device)[1]
    assert (plain["BLOCK_K"], paired_launch["BLOCK_K"]) == (block_k, min(2 * block_k, 4096))
    assert paired_launch["BLOCK_K"] > plain["BLOCK_K"]
