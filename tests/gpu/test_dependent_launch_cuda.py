"""Dependent launch (engine/layers/dependent_launch.py) on the GPU: a batch-1 layer chain of the
engine's kernels (residual add + norm, FP8 or 4-bit GEMVs, SiLU x mul) gives the same
bits launched dependent as launched normally, eager and replayed from a CUDA graph, where each
kernel reads what the one before it has just written. Timed by bench/gemv_chain.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.layers import dependent_launch as pdl  # noqa: E402
from kvfleet.engine.layers.linear import UnnormalizedRow  # noqa: E402
from kvfleet.engine.layers.quantization.fp8 import quantize_rows  # noqa: E402
from kvfleet.engine.layers.quantization.packed import quantize_rtn  # noqa: E402
from kvfleet.engine.layers.quantization.triton_packed import packed_gemv  # noqa: E402
from kvfleet.engine.layers.triton_gemv import gemv  # noqa: E402
from kvfleet.engine.layers.triton_layers import act_and_mul, add_rms_norm  # noqa: E402

HIDDEN, INNER, LAYERS = 4096, 14336, 4


SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN),
          "down": (HIDDEN, INNER)}  # fmt: skip


def _fp8_layers() -> list[dict[str, object]]:
    return [
        {
            name: quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
            for name, (n, k) in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]


def _int4_layers() -> list[dict[str, object]]:
    return [
        {
            name: quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, torch.bfloat16)
            for name, (n, k) in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]


def _chain(layers: list[dict[str, object]], linear: Callable[..., torch.Tensor], x: torch.Tensor,
           norm: torch.Tensor) -> torch.Tensor:  # fmt: skip
    hidden, residual = x, None
    for w in layers:
        y, residual = add_rms_norm(hidden, residual, norm, 1e-5)
        qkv = linear(y, w["qkv"])
        o = linear(qkv[:, :HIDDEN].contiguous(), w["o"])
        y, residual = add_rms_norm(o, residual, norm, 1e-5)
        hidden = linear(act_and_mul(linear(y, w["gate_up"])), w["down"])
    return hidden


def _chain_with_norms_in_gemvs(layers: list[dict[str, object]],
                               linear: Callable[..., torch.Tensor], x: torch.Tensor,
                               norm: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`_chain` with each residual add + norm made by the GEMV after it (`UnnormalizedRow`)."""
    hidden, residual = x, None
    for w in layers:
        row = UnnormalizedRow(hidden, residual, norm, 1e-5, False, torch.empty_like(hidden))
        qkv = linear(row, w["qkv"])
        o = linear(qkv[:, :HIDDEN].contiguous(), w["o"])
        row = UnnormalizedRow(o, row.residual_out, norm, 1e-5, False, torch.empty_like(o))
        hidden = linear(act_and_mul(linear(row, w["gate_up"])), w["down"])
        residual = row.residual_out
    return hidden


def _runs(
    monkeypatch: pytest.MonkeyPatch, fn: Callable[[], torch.Tensor], on: bool
) -> list[torch.Tensor]:
    """fn's result eager and replayed (three times) from a CUDA graph, launched dependent or not."""
    monkeypatch.setenv(pdl.ENV_SWITCH, "1" if on else "0")
    assert pdl.dependent_launch(torch.device("cuda")) == on
    eager = fn().clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = fn()
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    return [eager, *replays]


def _bf16_layers() -> list[dict[str, object]]:
    from kvfleet.engine.layers.linear import Linear

    def layer(n: int, k: int) -> Linear:
        made = Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(made.weight, std=0.02)
        return made

    return [{name: layer(n, k) for name, (n, k) in SHAPES.items()} for _ in range(LAYERS)]


def _chain_inputs(
    kind: str,
) -> tuple[list[dict[str, object]], Callable[[object, object], torch.Tensor], torch.Tensor,
           torch.Tensor]:  # fmt: skip
    """(layers, their product, a row x, a norm weight) for a chain of `kind` (seeded); skips
    where dependent launch cannot run."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launch needs compute capability 9.0")
    torch.manual_seed(0)
    layers, linear = _layers_and_linear(kind)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
    return layers, linear, x, norm


def _layers_and_linear(
    kind: str,
) -> tuple[list[dict[str, object]], Callable[[object, object], torch.Tensor]]:
    """LAYERS layers of `kind` ("bf16": the engine's `Linear`, "fp8", "int4") at SHAPES, and
    the one-row product `linear(x, layer's weight)` of that kind."""
    if kind == "bf16":
        return _bf16_layers(), lambda x, layer: layer(x)  # type: ignore[operator]
    if kind == "fp8":
        return _fp8_layers(), lambda x, w: gemv(x, *w)  # type: ignore[arg-type, misc]
    return _int4_layers(), packed_gemv  # type: ignore[return-value]


def test_a_bf16_layer_chain_launched_dependent_is_stable_and_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 layers whose small weights (qkv, o) take the Triton GEMV when launched dependent
    (cuBLAS otherwise: other bits): the same bits eager and in every replay, and within
    bf16's rounding of the cuBLAS chain."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launch needs compute capability 9.0")
    torch.manual_seed(0)
    layers = _bf16_layers()
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5

    def run() -> torch.Tensor:
        return _chain(layers, lambda x, layer: layer(x), x, norm)  # type: ignore[operator]

    plain = _runs(monkeypatch, run, on=False)
    dependent = _runs(monkeypatch, run, on=True)
    for got in dependent[1:]:
        assert torch.equal(got, dependent[0])
    error = (dependent[0].float() - plain[0].float()).norm() / plain[0].float().norm()
    assert error.item() < 2e-2


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_a_layer_chain_gives_the_same_bits_launched_dependent(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    layers, linear, x, norm = _chain_inputs(kind)

    def run() -> torch.Tensor:
        return _chain(layers, linear, x, norm)

    plain = _runs(monkeypatch, run, on=False)
    dependent = _runs(monkeypatch, run, on=True)
    assert torch.isfinite(plain[0]).all()
    assert plain[0].abs().max() > 0
    for got in plain[1:] + dependent:
        assert torch.equal(got, plain[0])


@pytest.mark.parametrize(
    ("n", "k"),
    [
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (5120, 2048),
        (2048, 4096),
        (128, 2048),
    ],
)
def test_the_bf16_gemv_matches_cublas(n: int, k: int) -> None:
    """The Triton GEMV the engine's `Linear` takes for one row of a bf16 weight, against
    F.linear in float32, beside cuBLAS's own bf16 result."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        cublas = torch.nn.functional.linear(x, weight, bias).float()
        got = gemv(x, weight, bias=bias).float()
        error = ((got - want).norm() / want.norm()).item()
        assert error <= 2 * ((cublas - want).norm() / want.norm()).item() + 1e-4


def test_the_linear_layer_takes_the_triton_gemv_up_to_its_size_only() -> None:
    from kvfleet.engine.layers.linear import TRITON_GEMV_MAX_BYTES, Linear

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launch needs compute capability 9.0")
    small = Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    large = Linear(4096, 128256, bias=False, device="cuda", dtype=torch.bfloat16)
    assert small.weight.numel() * 2 <= TRITON_GEMV_MAX_BYTES < large.weight.numel() * 2
    one = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    assert small.uses_triton_gemv(one)
    assert not large.uses_triton_gemv(one)
    assert not small.uses_triton_gemv(torch.cat([one, one], dim=1))
    want = torch.nn.functional.linear(one.float(), small.weight.float())
    got = small(one)
    assert got.shape == (1, 1, 6144)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_norms_made_in_the_gemvs_keep_the_chain(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The chain with each residual add + RMSNorm made inside the next GEMV (one kernel fewer
    each): the same bits eager and in every replay launched dependent, and the chain's result
    within rounding of the norm kernels' (the GEMV sums the row's squares in its own order)."""
    layers, linear, x, norm = _chain_inputs(kind)
    apart = _runs(monkeypatch, lambda: _chain(layers, linear, x, norm), on=True)
    fused = _runs(monkeypatch, lambda: _chain_with_norms_in_gemvs(layers, linear, x, norm), on=True)
    for got in fused[1:]:
        assert torch.equal(got, fused[0])
    assert torch.isfinite(fused[0]).all()
    error = (fused[0].float() - apart[0].float()).norm() / apart[0].float().norm()
    assert error.item() < 1e-2, error.item()


@pytest.mark.parametrize(("vocab", "hidden"), [(128256, 4096), (151936, 2048), (49152, 576)])
def test_one_rows_logits_through_the_gemv_match_cublas_float32(vocab: int, hidden: int) -> None:
    """The LM head at one row (`linear.float32_logits`): the Triton GEMV's float32 logits
    against cuBLAS's float32-out matmul, both summing bf16 products in float32: within float32
    summation order, the same greedy token."""
    from kvfleet.engine.layers.linear import float32_logits, lm_head_takes_gemv

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launch needs compute capability 9.0")
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.05
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        assert lm_head_takes_gemv(x, weight)
        got = float32_logits(x, weight)
        want = torch.mm(x, weight.t(), out_dtype=torch.float32)
        assert got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item() + 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))
