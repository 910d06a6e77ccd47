"""FP8 linear layers on the GPU at Llama-3-8B's shapes: the one-pass Triton row quantization
gives torch's exact values and scales, and the layer matches its dequantize-then-multiply
reference. (The Triton interpreter mis-rounds e4m3 on the CPU: this is checked here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.bench.bf16_agreement import first_difference, from_engine  # noqa: E402
from kvfleet.engine.layers import triton_gemv  # noqa: E402
from kvfleet.engine.layers.quantization.fp8 import (  # noqa: E402
    Fp8Linear,
    fp8_linear_reference,
    fp8_supported,
    quantize_rows,
)
from kvfleet.engine.layers.quantization.triton_fp8 import quantize_rows_triton  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("cols", [4096, 14336, 1000])
def test_triton_row_quantization_equals_torch(rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :5] = torch.tensor([448.0, -1000.0, 1e-6, 0.0, 2.5])
    values, scales = quantize_rows_triton(x)
    want_values, want_scales = quantize_rows(x)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0)
    assert torch.equal(values.float(), want_values.float())


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_layer_matches_its_reference_at_llama_shapes(n: int, k: int) -> None:
    assert fp8_supported(torch.device("cuda")) is None
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    dequantized = layer.weight.float() * layer.weight_scale
    for m in (1, 7, 64, 2048):  # (GEMV; Triton GEMM, a partial and a whole tile; cuBLASLt)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = layer(x).float()
        if m == 1 and triton_gemv.FP8_BF16_ROW:  # (W8A16 at one row: the row as it is)
            ref = x.float() @ dequantized.t()
        else:
            ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, None).float()
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
        exact = torch.nn.functional.linear(x.float(), linear.weight.float())
        assert (out - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_block_fp8_matches_its_reference_at_llama_shapes(n: int, k: int) -> None:
    from kvfleet.engine.layers.quantization.block_fp8 import BlockFp8Linear, block_fp8_reference

    weight = torch.randn(n, k, device="cuda") * 0.02
    layer = BlockFp8Linear(k, n, False, torch.bfloat16, (128, 128), online=True).cuda()
    layer.load_part("weight", weight, None, "w")
    for m in (1, 5, 64, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = layer(x).float()
        ref = block_fp8_reference(x, layer.weight, layer.weight_scale, (128, 128), None).float()
        # (the same e4m3 products; float32 sums in another order, then one bf16 rounding)
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
        exact = x.float() @ weight.t()
        assert (out - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("rows", [7, 256])
@pytest.mark.parametrize("hidden", [4096, 576])
def test_the_norm_and_silu_quantize_their_rows_as_torch(rows: int, hidden: int) -> None:
    """The norm's and SiLU x mul's kernels hand an FP8 layer its rows quantized: the e4m3
    values and scales of `quantize_rows` over their own outputs, bit for bit."""
    from kvfleet.engine.layers import triton_layers

    x, residual = torch.randn(2, rows, hidden, device="cuda", dtype=torch.bfloat16) * 3
    weight = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    quantized, got_residual = triton_layers.add_rms_norm_fp8(x, residual, weight, 1e-5)
    normed, want_residual = triton_layers.add_rms_norm(x, residual, weight, 1e-5)
    gate_up = torch.randn(rows, 7 * hidden, device="cuda", dtype=torch.bfloat16) * 2
    inner = triton_layers.act_and_mul(gate_up)
    assert torch.equal(got_residual, want_residual)
    for got, want in ((quantized, normed), (triton_layers.act_and_mul_fp8(gate_up), inner)):
        want_values, want_scales = quantize_rows(want)
        assert torch.equal(got.scales, want_scales)
        assert torch.equal(got.values.view(torch.uint8), want_values.view(torch.uint8))


def test_rows_quantized_in_their_producers_give_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FP8 Llama-3.2-1B shape (random weights, seeded), batched decode and prompts (CUDA
    graphs): the norm and SiLU x mul kernels quantizing the FP8 layers' rows give the tokens
    and logprobs of the layers' own quantization passes."""
    from kvfleet.engine.layers.quantization import fp8

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    prompts = [[128000 + i, *range(1000 + 7 * i, 1100 + 9 * i)] for i in range(12)]
    runs = []
    for in_producer in (True, False):
        monkeypatch.setattr(fp8, "QUANTIZE_IN_PRODUCER", in_producer)
        runs.append(_llama_1b_outputs([prompts], params, "fp8", num_blocks=1024, max_num_seqs=16))
    assert runs[0] == runs[1]


def _llama_1b_outputs(
    batches: list[list[list[int]]],
    params: SamplingParams,
    quantization: str | None,
    top: bool = False,
    **settings: int,
) -> list[Any]:
    """(tokens, logprobs) of each prompt of Llama-3.2-1B's shape (random weights, seeded, bf16)
    given in `batches` (each one `generate` call), or with `top` its `bf16_agreement.Run`
    (each step's top logprobs); the engine closed after."""
    from kvfleet.engine.llm import LLM

    llm = LLM("llama-3.2-1b", load_format="dummy", device="cuda", dtype="bfloat16",
              quantization=quantization, max_model_len=1024, **settings)  # fmt: skip
    outputs = [o for batch in batches for o in llm.generate(batch, params)]
    llm.engine.close()
    del llm
    torch.cuda.empty_cache()
    if top:
        return [from_engine(o) for o in outputs]
    completions = [o.outputs[0] for o in outputs]
    return [(c.token_ids, [lp.logprob for lp in c.logprobs or []]) for c in completions]


@pytest.fixture(scope="module")
def smollm2_quality(smollm2: Path) -> dict[str, object]:
    from kvfleet.bench.quality import compare, evaluate

    base = evaluate("smollm2", dtype="bfloat16", device="cuda")
    fp8 = evaluate("smollm2", dtype="bfloat16", device="cuda", quantization="fp8")
    return compare(base, fp8)


# NOTE: measured on the H100 (bench/RESULTS.md, 2026-11-24 session 13): 1 of 32 continuations
# equal, perplexity +2.11%. The two bf16 kernels paths of this model agree on only 22/32
# (bench/bf16_agreement.py), and FP8's rounding (2^-4 per element, weights and activations)
# is ten times bf16's: the agreement bar is out of reach for SmolLM2-135M; the perplexity bar
# is missed by 0.1 point (weight rounding alone: +1.6% in float32 on the CPU).
@pytest.mark.xfail(strict=True, reason="SmolLM2 FP8: 1/32 equal continuations (measured)")
def test_online_fp8_keeps_smollm2_greedy_continuations(smollm2_quality: dict[str, object]) -> None:
    print(smollm2_quality)
    assert int(smollm2_quality["equal_continuations"]) >= 28  # type: ignore[call-overload]


@pytest.mark.xfail(strict=True, reason="SmolLM2 FP8: perplexity +2.11% (measured)")
def test_online_fp8_keeps_smollm2_perplexity(smollm2_quality: dict[str, object]) -> None:
    assert float(smollm2_quality["perplexity_rise_pct"]) < 2.0  # type: ignore[arg-type]


def test_fp8_decode_graphs_give_the_eager_tokens_on_smollm2(smollm2: Path) -> None:
    from kvfleet.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"Question {i}: what is {i} times {i + 3}?" for i in range(12)]
    runs = []
    for eager in (True, False):
        llm = LLM(
            "smollm2",
            dtype="bfloat16",
            quantization="fp8",
            enforce_eager=eager,
            max_model_len=256,
            num_blocks=512,
            max_num_seqs=16,
        )
        assert llm.engine.quantization is not None
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_fused_gemv_matches_the_scaled_gemm(
    n: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-row GEMV quantizing its row (W8A8, `triton_gemv.FP8_BF16_ROW` off: the
    tensor-core form) against cuBLASLt's scaled GEMM; the row as it is: the layer's test."""
    from kvfleet.engine.layers.triton_gemv import gemv

    monkeypatch.setattr(triton_gemv, "FP8_BF16_ROW", False)

    weight, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1,):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for x_scale in (None, torch.tensor(0.01, device="cuda")):
            got = gemv(x, weight, scale, bias, x_scale).float()
            if x_scale is None:
                x_q, x_s = quantize_rows(x)
            else:
                x_s = x_scale.expand(m, 1)
                x_q = (x.float() / x_s).clamp(-448, 448).to(torch.float8_e4m3fn)
            want = torch._scaled_mm(
                x_q,
                weight.t(),
                scale_a=x_s.contiguous(),
                scale_b=scale.t(),
                bias=bias,
                out_dtype=torch.bfloat16,
            ).float()
            # (the same e4m3 values and products, float32 sums in another order; bf16 out)
            assert (got - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_tensor_core_gemv_over_quantized_rows_matches_the_scaled_gemm(n: int, k: int) -> None:
    """`fp8_rows_mma` at 2-64 rows (16, 32 and 64 columns, rows past M masked), with a bias and
    with a static input scale expanded over the rows, against cuBLASLt's scaled GEMM."""
    from kvfleet.engine.layers.triton_gemv import fp8_rows_mma

    weight, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (2, 16, 33, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x_q, x_s = quantize_rows(x)
        static = torch.tensor([[0.01]], device="cuda").expand(m, 1)
        for rows_scale, with_bias in ((x_s, True), (static, False)):
            got = fp8_rows_mma(x_q, rows_scale, weight, scale, bias if with_bias else None,
                               torch.bfloat16).float()  # fmt: skip
            want = torch._scaled_mm(x_q, weight.t(), scale_a=rows_scale.contiguous(),
                                    scale_b=scale.t(), bias=bias if with_bias else None,
                                    out_dtype=torch.bfloat16).float()  # fmt: skip
            assert got.shape == (m, n)
            assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (m, with_bias)


def test_long_sums_of_one_sign_keep_float32_precision() -> None:
    """Hopper's e4m3 tensor cores keep fewer bits than float32 in their sums: a kernel that
    lets the 14,336 positive products of a down projection's row run in them drifts low (the
    Triton GEMM did by 22%, the one-row tensor-core GEMV by 3%: cuBLASLt's `use_fast_accum`
    does too). Every path of the layer (GEMV, tensor-core GEMV over rows, Triton GEMM,
    cuBLASLt) adds 128-input parts into float32 as cuBLASLt does by default, whose bias here
    is -5.5e-4 (bench/RESULTS.md "2026-11-28 (session 26)")."""
    n, k = 4096, 14336
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.uniform_(0.0, 0.02)
    layer = Fp8Linear.from_linear(linear)
    for m in (1, 7, 16, 64, 2048):
        x = torch.rand(m, k, device="cuda", dtype=torch.bfloat16)
        out = layer(x).float()
        ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, None).float()
        relative = (out - ref) / ref
        assert relative.abs().max() <= 8e-3, m  # (two bf16 roundings: 2 x 2^-8 at most)
        assert relative.mean().abs() <= 1e-3, m  # (bf16 rounding averages out; truncation not)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_batch_1_decode_keeps_its_tokens_with_the_norms_in_the_gemvs(
    monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """One sequence's decode with each residual add + RMSNorm made by the GEMV after it (qkv,
    gate_up; `linear.NORM_IN_GEMV`) and with the norm kernels: the same tokens, logprobs
    within the rounding of the row's sum of squares (summed in another order). FP8 layers at
    one row multiply the row as it is (`triton_gemv.FP8_BF16_ROW`), where that rounding is not
    absorbed by the row's e4m3 rounding as it was with the row quantized (W8A8): there, as the
    bf16 paths are compared, the tokens equal until they first differ and there each run's
    token among the other's top 2 within 0.05 (measured: the first prompt's 21st token, 0.0098
    apart; bench/next/norms_fp8_diag.py), the logprobs before it within 0.05."""
    from kvfleet.engine.layers import linear, torch_layers

    taken = []
    takes_norm = torch_layers.takes_norm

    def spy(layer: object, x: torch.Tensor) -> bool:
        taken.append(takes_norm(layer, x))  # type: ignore[arg-type]
        return taken[-1]

    monkeypatch.setattr(torch_layers, "takes_norm", spy)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[128000 + i, *range(1000 + 7 * i, 1040 + 9 * i)] for i in range(3)]
    runs = []
    for in_gemv in (True, False):
        monkeypatch.setattr(linear, "NORM_IN_GEMV", in_gemv)
        batches = [[prompt] for prompt in prompts]  # (one sequence a step)
        runs.append(_llama_1b_outputs(batches, params, quantization, top=True, num_blocks=256,
                                      max_num_seqs=4))  # fmt: skip
        assert any(taken) == in_gemv
        taken.clear()
    near_ties = quantization == "fp8" and triton_gemv.FP8_BF16_ROW
    for mine, want in zip(*runs, strict=True):
        difference = first_difference(mine, want, top=2)
        assert difference is None or (near_ties and difference[1] < 0.05), difference
        at = len(want.token_ids) if difference is None else difference[0]
        mine_lp = [top[token] for top, token in zip(mine.tops, mine.token_ids, strict=True)]
        want_lp = [top[token] for top, token in zip(want.tops, want.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(mine_lp[:at], want_lp[:at], strict=True)) < 0.05
