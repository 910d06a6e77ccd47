"""The one-row Triton GEMV over bf16/fp16-style weights (engine/layers/triton_gemv.py) in the
interpreter, against F.linear: float32 and float16, a shape no tile divides, with and without a
bias. (Its e4m3 form: tests/unit/engine/quantization/test_fp8_linear.py; at real shapes on
the GPU: tests/gpu/test_dependent_launch_cuda.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kvfleet.engine.layers import triton_gemv
from kvfleet.engine.layers.linear import Linear, UnnormalizedRow
from kvfleet.engine.layers.triton_gemv import gemv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [16, 8])
def test_the_dense_gemv_equals_linear(dtype: torch.dtype, with_bias: bool, rows: int) -> None:
    """Over 4 tiles of inputs (the last partial), 16 or 8 rows a program."""
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(40, 200, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(1, 200, generator=generator).to(dtype)
    out = gemv(x, weight, bias=bias, tiles=(rows, 64, 4, 3))
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("n", "k", "planned"),
    [(16, 4000, (2048, 8)), (16, 2000, (2048, 8)), (80, 2000, (1024, 4)), (16, 5000, (1024, 4))],
)
def test_a_layer_whose_programs_fit_at_once_loads_half_its_inputs_a_tile(
    n: int, k: int, planned: tuple[int, int], kernel_launches: Any
) -> None:
    """16 rows (2 programs, at most 2 an SM of the interpreter's 4) take half of K a tile on 8
    warps (4000 -> 2048 inputs of 4096), or all of it where it fits 2048 (2000); 80 rows (10
    programs) keep the 4-warp plan (1,024-input tiles: WIDE_BF16), and so does a K whose half
    passes 2048 (its registers would leave one program an SM)."""
    launches = kernel_launches(triton_gemv, "_gemv_kernel")
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(n, k, generator=generator) * 0.1).half()
    x = torch.randn(1, k, generator=generator).half()
    out = gemv(x, weight)
    ((_, kwargs),) = launches
    assert (kwargs["BLOCK_K"], kwargs["num_warps"]) == planned
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2e-3,
                               atol=2e-3)  # fmt: skip


@pytest.mark.parametrize(("sms", "planned"), [(65, (512, 4)), (64, (256, 4))])
def test_sixteen_row_programs_take_512_inputs_where_four_an_sm_hold_them_all(
    sms: int, planned: tuple[int, int], kernel_launches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4,112 rows (16 a program: 257 programs) of 2,048 inputs take 512 inputs a tile where 65
    SMs hold them all, four each (a quarter of each program's weight before its wait), 256
    where 64 SMs would not; the output is the linear layer's either way."""
    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: sms)
    launches = kernel_launches(triton_gemv, "_gemv_kernel")
    generator = torch.Generator().manual_seed(6)
    weight = (torch.randn(4112, 2048, generator=generator) * 0.05).half()
    x = torch.randn(1, 2048, generator=generator).half()
    out = gemv(x, weight)
    ((grid, kwargs),) = launches
    assert grid == (257,)
    assert (kwargs["BLOCK_K"], kwargs["num_warps"]) == planned
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2e-3,
                               atol=2e-3)  # fmt: skip


def test_wide_bf16_tiles_take_1024_inputs_where_a_layer_does_not_preload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 layer of up to 4,096 outputs that does not preload (Llama-3-8B's o and down)
    takes 1,024 inputs a tile where it took 512 (WIDE_BF16); one that preloads (Qwen3-30B-A3B's
    o), a wider one (16 rows) and e4m3 weights keep their plans."""
    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    shapes = [(4096, 4096, 2), (4096, 14336, 2), (2048, 4096, 2), (6144, 4096, 2), (4096, 4096, 1)]
    wide = {shape: triton_gemv.one_row_plan(*shape, cpu) for shape in shapes}
    monkeypatch.setattr(triton_gemv, "WIDE_BF16", False)
    narrow = {shape: triton_gemv.one_row_plan(*shape, cpu) for shape in shapes}
    assert narrow[(4096, 4096, 2)] == narrow[(4096, 14336, 2)] == (8, 512, 4, 3)
    assert wide[(4096, 4096, 2)] == wide[(4096, 14336, 2)] == (8, 1024, 4, 3)
    for shape in shapes[2:]:
        assert wide[shape] == narrow[shape]
    assert triton_gemv.one_row_plan(600, 256, 2, cpu)[1] == 256  # (K's power of two)


def test_tuned_shapes_take_their_measured_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TUNED_ONE_ROW`: Phi-3-mini's bf16 qkv and Gemma-3-12B's gate_up take 8 x 1,024 on 4
    warps where the rules give 16 x 256; Llama-3-8B's gate_up (a shape not in the table) and
    e4m3 weights of a tuned shape keep the rules' plans; the qkv GEMV's rotation follows the
    plan's rows (`takes_rotary`: 4 pairs a program)."""
    from kvfleet.engine.layers.triton_gemv import takes_rotary

    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    shapes = [(30720, 3840, 2), (9216, 3072, 2), (28672, 4096, 2), (9216, 3072, 1)]
    tuned = {shape: triton_gemv.one_row_plan(*shape, cpu) for shape in shapes}
    monkeypatch.setattr(triton_gemv, "TUNED_ONE_ROW", {})
    ruled = {shape: triton_gemv.one_row_plan(*shape, cpu) for shape in shapes}
    assert ruled[(30720, 3840, 2)] == ruled[(9216, 3072, 2)] == (16, 256, 4, 3)
    assert tuned[(30720, 3840, 2)] == tuned[(9216, 3072, 2)] == (8, 1024, 4, 3)
    for shape in shapes[2:]:
        assert tuned[shape] == ruled[shape]
    phi3_qkv = torch.empty(9216, 3072, dtype=torch.bfloat16, device="meta")
    assert not takes_rotary(phi3_qkv, 4)  # (16-row programs: 8 pairs)
    monkeypatch.undo()
    assert takes_rotary(phi3_qkv, 4)


def test_scales_go_with_e4m3_weights_only() -> None:
    with pytest.raises(AssertionError, match="e4m3"):
        gemv(torch.ones(1, 8), torch.ones(4, 8), torch.ones(4, 1))


def test_the_linear_layer_keeps_cublas_off_hopper() -> None:
    """On the CPU (and any device that does not launch dependent) the layer is nn.Linear."""
    layer = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(1, 8, dtype=torch.bfloat16)
    assert not layer.uses_triton_gemv(x)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def _unnormalized_row(
    dtype: torch.dtype, with_residual: bool, offset: bool, seed: int
) -> UnnormalizedRow:
    """One row of 200 values (past every tile) before its RMSNorm, residual and weight drawn."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 200, generator=generator) * 3).to(dtype)
    residual = torch.randn(1, 200, generator=generator).to(dtype) if with_residual else None
    weight = (torch.rand(200, generator=generator) * (0.2 if offset else 1.5) + 0.1).to(dtype)
    return UnnormalizedRow(x, residual, weight, 1e-5, offset, torch.full_like(x, float("nan")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("with_residual", "offset"), [(True, False), (False, False), (True, True)])
def test_the_gemv_normalizes_its_row_as_the_norm_kernel_does(
    dtype: torch.dtype, with_residual: bool, offset: bool
) -> None:
    """An `UnnormalizedRow` through `gemv` gives, bit for bit, the GEMV of
    `triton_layers.add_rms_norm`'s output (with and without a residual, Gemma's 1 + weight),
    and writes that kernel's x + residual; over a weight of 40 rows in 16-row tiles."""
    from kvfleet.engine.layers import triton_layers

    row = _unnormalized_row(dtype, with_residual, offset, seed=7)
    generator = torch.Generator().manual_seed(8)
    weight = (torch.randn(40, 200, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype)
    normed, residual = triton_layers.add_rms_norm(row.x, row.residual, row.weight, row.eps, offset)
    want = gemv(normed, weight, bias=bias, tiles=(16, 64, 4, 3))
    got = gemv(row, weight, bias=bias, tiles=(16, 64, 4, 3))
    assert torch.equal(got, want)
    assert torch.equal(row.residual_out, residual)
    layer = Linear(200, 40).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(layer(row).float(), F.linear(normed, weight, bias).float(),
                               rtol=tolerance, atol=tolerance)  # fmt: skip


def test_the_norm_stays_in_its_own_kernel_off_hopper() -> None:
    from kvfleet.engine.layers.torch_layers import RMSNorm, takes_norm

    layer = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(1, 8, dtype=torch.bfloat16)
    assert not takes_norm(layer, x)
    normed, residual = RMSNorm(8, 1e-5, fused=True).to(torch.bfloat16).forward_for(layer, x)
    assert isinstance(normed, torch.Tensor)
    assert residual is x


def test_the_gemv_writes_float32_logits_from_its_float32_sums() -> None:
    """`out_dtype=float32` (the LM head's logits): the float32 sums as they are, where x's
    dtype would round them."""
    generator = torch.Generator().manual_seed(9)
    weight = (torch.randn(300, 200, generator=generator) * 0.1).to(torch.float16)
    x = torch.randn(1, 200, generator=generator).to(torch.float16)
    got = gemv(x, weight, tiles=(16, 64, 4, 3), out_dtype=torch.float32)
    assert got.dtype == torch.float32
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rounded = gemv(x, weight, tiles=(16, 64, 4, 3))
    assert torch.equal(rounded, got.to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tiles", "with_bias", "normalized", "qk_norm", "head"), [
    ((16, 64, 4, 3), False, False, None, 32), ((8, 64, 4, 3), True, False, None, 32),
    ((16, 64, 4, 3), True, True, None, 32), ((8, 64, 4, 3), False, True, "qk norms", 32),
    ((16, 64, 4, 3), False, False, "qk norms, 1 + w", 32),
    ((4, 64, 4, 3), False, True, "qk norms", 32), ((8, 64, 4, 3), False, True, None, 24),
])  # fmt: skip
def test_the_qkv_gemv_rotates_and_writes_the_cache_as_the_rope_kernel_does(
    dtype: torch.dtype,
    tiles: tuple[int, int, int, int],
    with_bias: bool,
    normalized: bool,
    qk_norm: str | None,
    head: int,
    block_layout: str,
) -> None:
    """A one-row qkv GEMV given a `RotaryWrite` (4 q heads, 2 KV heads of 32, or of 24 as
    Phi-3's 96 are no power of two, the row maybe its RMSNorm made inside, each head of q and
    k maybe RMS-normalized: Qwen3's, Gemma 3's)
    gives the bits of the GEMV then `rotary_and_write_kv`: q rotated in its output, rotated k
    and v in the cache at the token's slot, blocks token-major or head-major; no other slot
    touched; the heads' counters back at zero."""
    from kvfleet.engine.attention.metadata import cache_views
    from kvfleet.engine.layers.quantization.triton_packed import shared_workspace
    from kvfleet.engine.layers.torch_layers import RotaryEmbedding
    from kvfleet.engine.layers.triton_rope import QKNorm, RotaryWrite, rotary_and_write_kv

    generator = torch.Generator().manual_seed(11)
    weight = (torch.randn(8 * head, 200, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(8 * head, generator=generator).to(dtype) if with_bias else None
    cos, sin = RotaryEmbedding(head, 256, 10000.0).caches(torch.device("cpu"))
    positions, slots = torch.tensor([173]), torch.tensor([13])
    norm = None
    if qk_norm is not None:
        offset = qk_norm.endswith("1 + w")
        weights = (torch.rand(2, head, generator=generator) * 0.5 + 0.75).to(dtype)
        norm = QKNorm(weights[0], weights[1], 1e-6, offset)

    def row() -> torch.Tensor | UnnormalizedRow:
        if normalized:
            return _unnormalized_row(dtype, True, False, seed=12)
        return torch.randn(1, 200, generator=torch.Generator().manual_seed(12)).to(dtype)

    def target(cache: torch.Tensor) -> RotaryWrite:
        return RotaryWrite(positions, cos, sin, *cache_views(cache), slots, None, 4, 2, norm)

    expected_cache = torch.full((2, 6, 4, 2, head), 7.0, dtype=dtype)
    qkv = gemv(row(), weight, bias=bias, tiles=tiles)
    q, k = qkv[:, : 4 * head].view(1, 4, head), qkv[:, 4 * head : 6 * head].view(1, 2, head)
    rotary_and_write_kv(q, k, qkv[:, 6 * head :].view(1, 2, head), positions, cos, sin,
                        *cache_views(expected_cache), slots, None, norm)  # fmt: skip
    cache = torch.full_like(expected_cache, 7.0)
    out = gemv(row(), weight, bias=bias, tiles=tiles, rotary=target(cache))
    assert torch.equal(out[:, : 4 * head], qkv[:, : 4 * head])
    assert torch.equal(cache, expected_cache)
    assert not shared_workspace(out.device, 0, 6).counters.any()


def test_a_qkv_layer_takes_the_rotary_gemv_where_its_programs_stay_in_one_head() -> None:
    """`takes_rotary`: each program's BLOCK_N / 2 pairs in one head (Llama-3-8B's qkv: 16-row
    bf16 blocks, 8 pairs; the W8A8 plans' 64-row e4m3 ones, 32 pairs); a `Linear` given a row
    tensor its GEMV does not take (here, on the CPU) leaves it to the unfused path: None."""
    from kvfleet.engine.layers.quantization.fp8 import FP8
    from kvfleet.engine.layers.torch_layers import RotaryEmbedding
    from kvfleet.engine.layers.triton_gemv import takes_rotary
    from kvfleet.engine.layers.triton_rope import RotaryWrite

    bf16 = torch.empty(6144, 4096, dtype=torch.bfloat16, device="meta")
    e4m3 = torch.empty(6144, 4096, dtype=FP8, device="meta")
    assert [takes_rotary(bf16, half) for half in (64, 8, 4, 48)] == [True, True, False, True]
    assert not takes_rotary(bf16, 48, qk_norm=True)  # (a head normalized in one tile: 2^n)
    assert takes_rotary(bf16, 64, qk_norm=True)
    if triton_gemv.FP8_BF16_ROW:  # e4m3 rows taken as they are: the bf16 plans
        assert [takes_rotary(e4m3, half) for half in (64, 8, 4)] == [True, True, False]
    else:  # the W8A8 plans' 64-row blocks
        assert [takes_rotary(e4m3, half) for half in (64, 32, 16)] == [True, True, False]
    layer = Linear(200, 8 * 32, bias=False)
    cos, sin = RotaryEmbedding(32, 256, 10000.0).caches(torch.device("cpu"))
    cache = torch.zeros(2, 6, 4, 2, 32)
    target = RotaryWrite(torch.tensor([3]), cos, sin, cache[0], cache[1], torch.tensor([3]),
                         None, 4, 2)  # fmt: skip
    assert layer.forward_rotated(torch.randn(1, 200), target) is None
