"""The Triton W4A16 kernels (and their 8-bit form) on the GPU at Llama-3-8B's shapes against
their dequantize-then-multiply reference (bf16 activations; group 128; act-order and a bias
too). Timed by bench/int4_gemm.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.layers.quantization.packed import (  # noqa: E402
    packed_linear_reference,
    quantize_rtn,
)
from kvfleet.engine.layers.quantization.triton_packed import packed_matmul  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_matches_its_reference(n: int, k: int, act_order: bool) -> None:
    weights = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02, 128, torch.bfloat16)
    if act_order:
        weights.perm = torch.randperm(k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 1, 7, 7, 32, 64, 512):  # (twice: the split-K counters reset)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = packed_matmul(x, weights, bias).float()
        want = packed_linear_reference(x.float(), weights, bias.float())
        # (bf16 dequantized weights in the tensor-core path and a bf16 output: bf16's rounding)
        assert (got - want).norm() / want.norm() < 1e-2, m


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_8_bit_words_match_their_reference(n: int, k: int) -> None:
    """The same kernels over 8-bit values (GGUF Q8_0's: group 32, zero 128)."""
    from kvfleet.engine.layers.quantization.packed import PackedWeights, pack_rows

    q = torch.randint(0, 256, (k, n), device="cuda")
    scales = (torch.rand(k // 32, n, device="cuda") * 2e-4 + 1e-5).to(torch.bfloat16)
    zeros = torch.full((k // 32, n), 128.0, device="cuda", dtype=torch.bfloat16)
    weights = PackedWeights(pack_rows(q, bits=8), scales, zeros, 32, bits=8)
    for m in (1, 1, 7, 32, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = packed_matmul(x, weights).float()
        want = packed_linear_reference(x.float(), weights)
        assert (got - want).norm() / want.norm() < 1e-2, m


def test_a_gguf_with_q4_and_q8_0_layers_serves_packed(tmp_path: object) -> None:
    """quantization='gguf' on the GPU (CUDA graphs, Triton kernels), float32: a file mixing
    Q4_0, Q4_1 and Q8_0 projections (4-bit layers, 8-bit ones, 8-bit ones with Q4 parts)
    generates what the same file dequantized generates, logprobs within 1e-3."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    import tests.unit.engine.test_gguf_loader as tiny
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    path = Path(str(tmp_path)) / "mixed.gguf"
    saved = tiny.LAYER_TYPES
    tiny.LAYER_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q8_0, Q.Q4_1, Q.Q8_0]
    try:
        tiny.write_model(path, tied=False)
    finally:
        tiny.LAYER_TYPES = saved
    prompts = [list(range(1, 2 + 3 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    runs = []
    for quantization in (None, "gguf"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, max_model_len=256,
                  num_blocks=512, skip_tokenizer_init=True)  # fmt: skip
        try:
            runs.append(list(llm.generate(prompts, params)))
        finally:
            llm.engine.close()
    for plain, packed in zip(*runs, strict=True):
        assert plain.outputs[0].token_ids == packed.outputs[0].token_ids
        for a, b in zip(plain.outputs[0].logprobs, packed.outputs[0].logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3
