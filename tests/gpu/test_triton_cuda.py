"""The Triton attention path on the GPU: kernels at real shapes, and SmolLM2 against the torch path.

Kernels: bf16 inputs, compared with the torch backend run in float32 on the same (upcast)
inputs; relative error ||out - ref|| / ||ref|| under 1e-2, outputs poisoned with NaN first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvfleet.engine.attention import triton_attention  # noqa: E402
from kvfleet.engine.attention.torch_backend import TorchAttention  # noqa: E402
from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.loader import model_cache  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402

LLAMA_8B_HEADS = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
CASES = {
    "decode-64": ([1] * 64, [17 + 61 * i for i in range(64)]),
    "chunk-after-prefix": ([512, 1], [2048, 3000]),
    "mixed": ([1, 300, 1, 1000, 1], [4096, 300, 1, 1500, 2222]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_torch_at_real_shapes(
    attention_case: Callable[..., dict[str, Any]], case: str
) -> None:
    query_lens, seq_lens = CASES[case]
    inputs = attention_case(
        query_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=3, **LLAMA_8B_HEADS
    )
    metadata = inputs["metadata"]
    reference = TorchAttention(32, 8, 128)
    cache32 = inputs["kv_cache"].float()
    expected = reference.forward(
        inputs["q"].float(), inputs["k"].float(), inputs["v"].float(), cache32, metadata
    )
    cache = inputs["kv_cache"].clone()
    triton_attention.write_kv_cache(inputs["k"], inputs["v"], cache, metadata.slot_mapping)
    assert torch.equal(cache.float(), cache32)
    out = torch.full_like(inputs["q"], float("nan"))
    triton_attention.paged_attention(inputs["q"], cache, metadata, reference.scale, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    relative = float((out.float() - expected).norm() / expected.norm())
    assert relative < 1e-2, relative


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [CASES["decode-64"], ([1], [8191]), ([1] * 3, [5, 3000, 130])],
    ids=["decode-64", "one-8k", "three"],
)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_kernel_matches_torch_at_real_shapes(
    attention_case: Callable[..., dict[str, Any]],
    query_lens: list[int],
    seq_lens: list[int],
    num_splits: int | None,
) -> None:
    from kvfleet.engine.attention import triton_decode

    inputs = attention_case(
        query_lens, seq_lens, dtype=torch.bfloat16, device="cuda", seed=4, **LLAMA_8B_HEADS
    )
    metadata = inputs["metadata"]
    reference = TorchAttention(32, 8, 128)
    cache = inputs["kv_cache"].clone()
    expected = reference.forward(
        inputs["q"].float(), inputs["k"].float(), inputs["v"].float(), cache.float(), metadata
    )
    triton_attention.write_kv_cache(inputs["k"], inputs["v"], cache, metadata.slot_mapping)
    out = torch.full_like(inputs["q"], float("nan"))
    triton_decode.decode_attention(
        inputs["q"], cache, metadata, reference.scale, out=out, num_splits=num_splits
    )
    torch.cuda.synchronize()
    assert not out.isnan().any()
    relative = float((out.float() - expected).norm() / expected.norm())
    assert relative < 1e-2, relative


def _smollm2_available() -> None:
    try:
        model_cache.ModelCache(model_cache.kvfleet_home()).fetch(
            model_cache.BUILTIN_MODELS["smollm2"], progress=False
        )
    except model_cache.ModelCacheError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")


@pytest.mark.xfail(
    strict=True,
    reason="issue 5's bar (>= 95% of 32 greedy bf16 continuations equal) is not met by any two "
    "independent bf16 implementations of this model: measured on the H100 (2026-11-22, "
    "bench/bf16_agreement.py) triton vs torch 22/32, Hugging Face bf16 vs its own float32 18/32, "
    "HF bf16 vs ours 17/32, while triton == torch == HF in float32 (32/32) and runs repeat "
    "exactly; see bench/RESULTS.md",
)
def test_smollm2_triton_agrees_with_torch_path() -> None:
    _smollm2_available()
    topics = ["rivers", "chess", "volcanoes", "bread", "satellites", "owls", "glass", "jazz"]
    prompts = [
        f"{kind} about {topic}:"
        for topic in topics
        for kind in ("A poem", "Facts", "A story", "Notes")
    ]
    assert len(prompts) == 32
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            "smollm2",
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend,
            max_model_len=1024,
            num_blocks=1024,
        )
        assert llm.engine.attention_backend == backend
        outputs[backend] = llm.generate(prompts, params)
        del llm
    agree = 0
    gaps = []
    for ours, ref in zip(outputs["triton"], outputs["torch"], strict=True):
        a, b = ours.outputs[0], ref.outputs[0]
        agree += a.token_ids == b.token_ids
        # First sampled position: logprobs of every token in both top-20 lists.
        first_a, first_b = (a.logprobs or [])[0], (b.logprobs or [])[0]
        lookup_b = dict(zip(first_b.top_token_ids, first_b.top_logprobs, strict=True))
        gaps += [
            abs(v - lookup_b[t])
            for t, v in zip(first_a.top_token_ids, first_a.top_logprobs, strict=True)
            if t in lookup_b
        ]
    print(
        f"greedy agreement {agree}/32; first-step logprobs: {len(gaps)} compared, "
        f"max |diff| {max(gaps):.3f}"
    )
    assert agree >= 31  # at least 95% of the 32 prompts
    assert len(gaps) >= 32 * 15
    assert max(gaps) < 0.15  # bf16 rounding through 30 layers


def test_fused_layers_match_torch_at_real_shapes() -> None:
    from kvfleet.engine.layers.torch_layers import RMSNorm, RotaryEmbedding
    from kvfleet.engine.layers.triton_layers import add_rms_norm, rotary_inplace

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 4096, generator=gen).cuda().bfloat16()
    residual = torch.randn(300, 4096, generator=gen).cuda().bfloat16()
    norm = RMSNorm(4096, 1e-5).cuda()
    with torch.no_grad():
        expected, expected_residual = norm(x.float(), residual.float())
        out, out_residual = add_rms_norm(x, residual, norm.weight.bfloat16(), 1e-5)
    assert float((out.float() - expected).norm() / expected.norm()) < 1e-2
    assert (
        float((out_residual.float() - expected_residual).norm() / expected_residual.norm()) < 1e-2
    )

    rotary = RotaryEmbedding(128, 8192, 500000.0)
    positions = torch.randint(0, 8192, (300,), generator=gen).cuda()
    q = torch.randn(300, 32, 128, generator=gen).cuda().bfloat16()
    expected_q, _ = rotary(positions, q.float(), q.float()[:, :1])
    out_q = torch.full_like(q, float("nan"))
    out_q.copy_(q)
    rotary_inplace(out_q, positions, rotary.cos_cache, rotary.sin_cache)
    assert not out_q.isnan().any()
    assert float((out_q.float() - expected_q).norm() / expected_q.norm()) < 1e-2


def test_cuda_graph_decode_equals_eager(hf_model_dir: Callable[[str], tuple[Any, Path]]) -> None:
    """Graph replays give the eager path's tokens and logprobs, as batches shrink and grow
    (padding rows over slots a larger batch used before)."""
    _, folder = hf_model_dir("llama3-rope-untied")
    prompts = [[5 + (7 * i + j) % 300 for j in range(10 + 9 * i)] for i in range(7)]
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True, logprobs=2)
        for i in range(7)
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(folder),
            device="cuda",
            dtype="float32",
            skip_tokenizer_init=True,
            num_blocks=128,
            max_model_len=256,
            enforce_eager=eager,
        )
        outs = llm.generate(prompts, params) + llm.generate(prompts[:3], params[:3])
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert len(graphs.graphs) >= 3  # several buckets were captured and replayed
        results[eager] = [
            (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []])
            for o in outs
        ]
    for (eager_ids, eager_lp), (graph_ids, graph_lp) in zip(
        results[True], results[False], strict=True
    ):
        assert graph_ids == eager_ids
        assert max(abs(a - b) for a, b in zip(eager_lp, graph_lp, strict=True)) < 1e-4


def test_fused_rope_and_silu_round_like_the_torch_path_in_bf16() -> None:
    """Not just close: RoPE and SiLU·mul round where the torch chain rounds, so at most a few
    elements differ, each by one bf16 step (exp and sin/cos are computed differently)."""
    from kvfleet.engine.layers import torch_layers as layers
    from kvfleet.engine.layers import triton_layers

    gen = torch.Generator().manual_seed(6)
    rotary = layers.RotaryEmbedding(128, 8192, 500000.0)
    positions = torch.randint(0, 8192, (300,), generator=gen).cuda()
    q = torch.randn(300, 32, 128, generator=gen).cuda().bfloat16()
    expected_q, _ = rotary(positions, q.clone(), q[:, :1].clone())
    triton_layers.rotary_inplace(q, positions, rotary.cos_cache, rotary.sin_cache)
    gate_up = (torch.randn(300, 2 * 14336, generator=gen) * 3).cuda().bfloat16()
    expected_silu = layers.act_and_mul(gate_up)
    silu = triton_layers.act_and_mul(gate_up)
    for name, out, expected in (("rope", q, expected_q), ("silu", silu, expected_silu)):
        differ = (out != expected).float().mean().item()
        # One bf16 step at each element's magnitude: 2^-7 relative, at most.
        steps = (out.float() - expected.float()).abs() / expected.float().abs().clamp(min=1e-30)
        print(f"{name}: {differ:.2e} of elements differ; max relative difference {steps.max():.2e}")
        assert differ < 1e-3, (name, differ)
        assert float(steps.max()) <= 2**-7, name
