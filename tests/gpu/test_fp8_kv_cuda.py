"""The FP8 KV cache's Triton kernels on the GPU at Llama-3-8B's head shapes (and Gemma's heads
of 256): the cache writes (alone and fused with RoPE) store the torch backend's bytes, and
prompt and decode attention over an e4m3 cache match the torch backend reading the same cache
(float32)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.attention import (  # noqa: E402
    torch_backend,
    triton_attention,
    triton_decode,
    triton_prompt,
)
from kvfleet.engine.attention.torch_backend import TorchAttention  # noqa: E402

FP8 = torch.float8_e4m3fn
HEADS = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
# (Gemma 2 / 3's heads of 256: the kernels' tiles take fewer tokens, `kv_tile_tokens`)
SHAPES = {"llama": HEADS, "gemma": {"num_heads": 16, "num_kv_heads": 8, "head_dim": 256}}
CASES = {
    "decode-64": ([1] * 64, [17 + 61 * i for i in range(64)]),
    "chunk-after-prefix": ([512, 1], [2048, 3000]),
    "mixed": ([1, 300, 1, 1000, 1], [4096, 300, 1, 1500, 2222]),
    # (as the runner orders a mixed step: the backend sends the decodes to the decode kernel)
    "decodes-first": ([1] * 40 + [300, 1000, 1], [17 + 97 * i for i in range(40)] + [300, 1500, 9]),
}


def _fp8_case(
    attention_case: Callable[..., dict[str, Any]], case: str, heads: dict[str, int] = HEADS
) -> dict[str, Any]:
    inputs = attention_case(*CASES[case], dtype=torch.bfloat16, device="cuda", seed=5, **heads)
    scales = torch.tensor([0.02, 0.015], device="cuda")  # (K and V up to ~4.5 and ~3.4 x 448)
    cache = inputs["kv_cache"].float()
    inputs["kv_cache"] = torch.stack(
        [(cache[i] / scales[i]).clamp(-448, 448).to(FP8) for i in (0, 1)]
    )  # (the prefix already in the cache, stored as an FP8 cache stores it)
    inputs["scales"] = scales
    return inputs


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_cache_kernels_match_the_torch_backend(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    shape: str,
) -> None:
    """The upcasting kernels and the backend over them (the decode kernel's e4m3 products off:
    they are e4m3's rounding away, test_e4m3_products_decode_stays_within_e4m3s_rounding)
    within bf16's rounding of the torch backend."""
    heads = SHAPES[shape]
    monkeypatch.setattr(triton_decode, "E4M3_PRODUCTS", False)
    inputs = _fp8_case(attention_case, case, heads)
    metadata, scales = inputs["metadata"], inputs["scales"]
    reference = TorchAttention(*heads.values())
    ref_cache = inputs["kv_cache"].clone()
    expected = reference.forward(
        inputs["q"].float(), inputs["k"].float(), inputs["v"].float(), ref_cache, metadata, scales
    )
    cache = inputs["kv_cache"].clone()
    triton_attention.write_kv_cache(inputs["k"], inputs["v"], cache, metadata.slot_mapping, scales)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    kernels = [triton_prompt.paged_attention]
    if metadata.max_seqlen_q == 1:
        kernels.append(triton_decode.decode_attention)
    for kernel in kernels:
        out = torch.full_like(inputs["q"], float("nan"))
        kernel(inputs["q"], cache, metadata, reference.scale, out=out, kv_scales=scales)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        # (the kernels upcast K and V to float16 in registers and meet them with the query
        # in float16, K's scale on the scores: bf16's rounding of the output bounds it)
        relative = float((out.float() - expected).norm() / expected.norm())
        assert relative < 1e-2, (kernel.__name__, relative)
    # The backend: a mixed step's leading decodes through the decode kernel, the rest varlen.
    backend = triton_attention.TritonAttention(*heads.values())
    out = backend.forward(inputs["q"], inputs["k"], inputs["v"], cache, metadata, scales)
    relative = float((out.float() - expected).norm() / expected.norm())
    assert relative < 1e-2, ("backend", relative)


def test_the_fused_rope_write_stores_the_torch_bytes() -> None:
    from kvfleet.engine.attention.metadata import cache_views
    from kvfleet.engine.layers.torch_layers import RotaryEmbedding
    from kvfleet.engine.layers.triton_rope import rotary_and_write_kv, rotary_inplace

    gen = torch.Generator().manual_seed(6)
    rotary = RotaryEmbedding(128, 8192, 500000.0)
    num_tokens, block_size = 300, 16
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen).cuda()
    slots = (torch.randperm(40 * block_size, generator=gen)[:num_tokens] + block_size).cuda()
    q = torch.randn(num_tokens, 32, 128, generator=gen).cuda().bfloat16()
    k = torch.randn(num_tokens, 8, 128, generator=gen).cuda().bfloat16() * 3
    v = torch.randn(num_tokens, 8, 128, generator=gen).cuda().bfloat16()
    scales = torch.tensor([0.01, 0.005], device="cuda")
    cos, sin = rotary.caches(torch.device("cuda"))
    want_q, want_k = q.clone(), k.clone()
    rotary_inplace(want_q, positions, cos, sin)
    rotary_inplace(want_k, positions, cos, sin)
    want = torch.zeros(2, 48, block_size, 8, 128, dtype=FP8, device="cuda")
    torch_backend.write_kv_cache(want_k, v, want, slots, scales)
    cache = torch.zeros_like(want)
    rotary_and_write_kv(q, k, v, positions, cos, sin, *cache_views(cache), slots, scales)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("case", list(CASES))
def test_head_major_blocks_give_the_token_major_bits(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """The same FP8 cache held head-major (as the engine holds it: K [head, slot, dim], V
    token-minor) and token-major (as it did before): the prompt and upcasting decode kernels
    give the same bits, the cache writes store the same values (`cache_views` reads both
    alike). (The e4m3-products decode kernel reads head-major blocks only.)"""
    from kvfleet.engine.attention import metadata as attention_metadata

    monkeypatch.setattr(triton_decode, "E4M3_PRODUCTS", False)
    inputs = _fp8_case(attention_case, case)
    metadata, scales = inputs["metadata"], inputs["scales"]
    head_major = torch.empty_like(inputs["kv_cache"])
    views = attention_metadata.cache_views(head_major)
    for view, values in zip(views, inputs["kv_cache"], strict=True):
        view.view(torch.uint8).copy_(values.view(torch.uint8))
    caches: dict[bool, torch.Tensor] = {}
    outputs: dict[bool, list[torch.Tensor]] = {}
    for by_head in (False, True):
        monkeypatch.setattr(attention_metadata, "head_major_blocks", lambda c, m=by_head: m)
        cache = (head_major if by_head else inputs["kv_cache"]).clone()
        triton_attention.write_kv_cache(
            inputs["k"], inputs["v"], cache, metadata.slot_mapping, scales
        )
        kernels = [triton_prompt.paged_attention]
        if metadata.max_seqlen_q == 1:
            kernels.append(triton_decode.decode_attention)
        outputs[by_head] = [
            kernel(inputs["q"], cache, metadata, 0.088, kv_scales=scales) for kernel in kernels
        ]
        caches[by_head] = torch.stack(
            [view.view(torch.uint8) for view in attention_metadata.cache_views(cache)]
        )
    assert torch.equal(caches[False], caches[True])
    for token_major, by_head_out in zip(outputs[False], outputs[True], strict=True):
        assert torch.equal(token_major, by_head_out)


def _e4m3_errors(
    monkeypatch: pytest.MonkeyPatch,
    inputs: dict[str, Any],
    heads: dict[str, int],
    module: Any,
    kernel: Callable[..., torch.Tensor],
    **launch: Any,
) -> dict[bool, float]:
    """The relative error of `kernel` against the torch backend over the same FP8 cache,
    `module.E4M3_PRODUCTS` off (False) and on (True)."""
    metadata, scales, cache = inputs["metadata"], inputs["scales"], inputs["kv_cache"].clone()
    reference = TorchAttention(*heads.values())
    # (the reference writes the step's keys and values into the cache, then the kernel reads it)
    expected = reference.forward(inputs["q"].float(), inputs["k"].float(), inputs["v"].float(),
                                 cache, metadata, scales)  # fmt: skip
    errors = {}
    for products in (False, True):
        monkeypatch.setattr(module, "E4M3_PRODUCTS", products)
        out = torch.full_like(inputs["q"], float("nan"))
        kernel(inputs["q"], cache, metadata, reference.scale, out=out, kv_scales=scales, **launch)
        torch.cuda.synchronize()
        assert not out.isnan().any()
        errors[products] = float((out.float() - expected).norm() / expected.norm())
    print(f"relative error: upcasts {errors[False]:.2e}, e4m3 products {errors[True]:.2e}")
    return errors


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_splits", [1, 4])
def test_e4m3_products_decode_stays_within_e4m3s_rounding(
    attention_case: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
    num_splits: int,
) -> None:
    """`triton_decode_e4m3` (the query and the softmax weights rounded to e4m3, products of
    e4m3 values) against the torch backend over the same cache: within e4m3's rounding
    (2^-4 of a value at most) of the reference, beside the upcasting kernel's error."""
    heads = SHAPES[shape]
    inputs = _fp8_case(attention_case, "decode-64", heads)
    errors = _e4m3_errors(monkeypatch, inputs, heads, triton_decode,
                          triton_decode.decode_attention, num_splits=num_splits)  # fmt: skip
    assert errors[False] < 1e-2
    assert errors[True] < 2**-4


@pytest.mark.parametrize("case", ["chunk-after-prefix", "mixed"])
def test_e4m3_products_prompt_kernel_stays_within_e4m3s_rounding(
    attention_case: Callable[..., dict[str, Any]], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The prompt kernel's E4M3_OPERANDS (each query row and the softmax weights rounded to
    e4m3, products of e4m3 values) against the torch backend over the same cache: within
    e4m3's rounding of the reference, beside the upcasting path's error."""
    inputs = _fp8_case(attention_case, case)
    errors = _e4m3_errors(monkeypatch, inputs, HEADS, triton_prompt, triton_prompt.paged_attention)
    assert errors[False] < 1e-2
    assert errors[True] < 2**-4
