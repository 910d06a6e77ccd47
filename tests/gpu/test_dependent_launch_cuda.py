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
from kvfleet.engine.layers.quantization.fp8 import quantize_rows  # noqa: E402
from kvfleet.engine.layers.quantization.packed import quantize_rtn  # noqa: E402
from kvfleet.engine.layers.quantization.triton_fp8 import fp8_gemv  # noqa: E402
from kvfleet.engine.layers.quantization.triton_packed import packed_gemv  # noqa: E402
from kvfleet.engine.layers.triton_layers import act_and_mul, add_rms_norm  # noqa: E402

HIDDEN, INNER, LAYERS = 4096, 14336, 4


def _fp8_layers() -> list[dict[str, object]]:
    shapes = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN),
              "down": (HIDDEN, INNER)}  # fmt: skip
    return [
        {
            name: quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
            for name, (n, k) in shapes.items()
        }
        for _ in range(LAYERS)
    ]


def _int4_layers() -> list[dict[str, object]]:
    shapes = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN),
              "down": (HIDDEN, INNER)}  # fmt: skip
    return [
        {
            name: quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, torch.bfloat16)
            for name, (n, k) in shapes.items()
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


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_a_layer_chain_gives_the_same_bits_launched_dependent(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launch needs compute capability 9.0")
    torch.manual_seed(0)
    if kind == "fp8":
        layers = _fp8_layers()

        def linear(x: torch.Tensor, w: object) -> torch.Tensor:
            return fp8_gemv(x, *w)  # type: ignore[misc]
    else:
        layers = _int4_layers()
        linear = packed_gemv
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5

    def run() -> torch.Tensor:
        return _chain(layers, linear, x, norm)

    plain = _runs(monkeypatch, run, on=False)
    dependent = _runs(monkeypatch, run, on=True)
    assert torch.isfinite(plain[0]).all()
    assert plain[0].abs().max() > 0
    for got in plain[1:] + dependent:
        assert torch.equal(got, plain[0])
