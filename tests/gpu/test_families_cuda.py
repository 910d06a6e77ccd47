"""The model families beyond Llama on the GPU: their layers at the shipped configs' real shapes
through Triton and CUDA graphs, against the torch reference path; the fused MoE kernels at
Qwen3-30B-A3B and Mixtral-8x7B shapes against their reference.

Engine runs keep the shipped config's every layer shape but two layers (the whole of Mixtral
does not fit one GPU in float32): float32 with TF32 off, greedy tokens equal and logprobs
within 1e-3. Kernels: bf16 against the reference over the same bf16 weights (its matmuls in
bf16, SiLU * up and the sum in float32), relative error under 1e-2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvfleet.bench.bf16_agreement import first_difference, from_engine  # noqa: E402
from kvfleet.engine.layers.linear import UnnormalizedRow  # noqa: E402
from kvfleet.engine.layers.moe import (  # noqa: E402
    align_rows,
    experts_reference,
    route,
)
from kvfleet.engine.layers.triton_moe import block_m_for, fused_experts  # noqa: E402
from kvfleet.engine.layers.triton_moe_gemv import one_token_moe  # noqa: E402
from kvfleet.engine.layers.triton_route import (  # noqa: E402
    ROUTE_IN_ALIGN_TOKENS,
    align_rows_fused,
    route_and_align_fused,
    route_fused,
)
from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402
from tests.unit.engine.triton.test_moe_kernels import by_run  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "engine" / "configs"
# (experts, top k, hidden, inner) of one MoE layer
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


def _moe_layer(
    shape: str, num_tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, w13, w2, router logits) of one MoE layer at `shape`, bf16, drawn from `seed`."""
    experts, _, hidden, inner = MOE_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device="cuda") * scale).bfloat16()

    x = randn(num_tokens, hidden)
    w13 = randn(experts, 2 * inner, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inner, scale=inner**-0.5)
    return x, w13, w2, randn(num_tokens, experts)


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 2048])
def test_fused_experts_match_reference_at_real_shapes(shape: str, num_tokens: int) -> None:
    top_k = MOE_SHAPES[shape][1]
    x, w13, w2, logits = _moe_layer(shape, num_tokens, seed=num_tokens)
    weights, ids = route(logits.float(), top_k, renormalize=True)
    expected = experts_reference(x, w13, w2, weights, ids).float()
    out = fused_experts(x, w13, w2, weights, ids).float()
    relative = float((out - expected).norm() / expected.norm())
    assert relative < 1e-2, relative


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("down_all", [True, False])
def test_one_token_gemvs_match_reference_at_real_shapes(
    shape: str, seed: int, down_all: bool
) -> None:
    """A batch-1 step's layer as two GEMVs (the router's top k found in each gate_up program;
    down over all k experts a program, or split over them), bf16, from the router's logits
    on."""
    top_k = MOE_SHAPES[shape][1]
    x, w13, w2, logits = _moe_layer(shape, 1, seed)
    weights, ids = route(logits, top_k, renormalize=True)
    expected = experts_reference(x, w13, w2, weights, ids).float()
    out = one_token_moe(x, logits, w13, w2, top_k, renormalize=True, down_all=down_all).float()
    relative = float((out - expected).norm() / expected.norm())
    assert relative < 1e-2, relative


def test_one_tokens_experts_take_the_row_unnormalized() -> None:
    """At Qwen3-30B-A3B's shape, bf16, launched dependent: the norm before the experts is left
    to the router's and the gate_up GEMV (`takes_norm`), and the layer's output is the one of
    the norm kernel's row within rounding (each kernel sums the row's squares in its order)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the Triton GEMVs launch dependent: compute capability 9.0")
    from kvfleet.engine.layers.moe import SparseMoeBlock
    from kvfleet.engine.layers.torch_layers import RMSNorm

    experts, top_k, hidden, inner = MOE_SHAPES["qwen3-30b-a3b"]
    block = SparseMoeBlock(experts, hidden, inner, top_k, True, fused=True)
    norm = RMSNorm(hidden, 1e-6, fused=True)
    block, norm = block.cuda().bfloat16(), norm.cuda().bfloat16()
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for param in (block.gate.weight, block.w13, block.w2):
            param.copy_(torch.randn(param.shape, generator=gen, device="cuda") / hidden**0.5)
        norm.weight.copy_(torch.rand(hidden, generator=gen, device="cuda") + 0.5)
    x, residual = torch.randn(2, 1, hidden, generator=gen, device="cuda").bfloat16()
    row, residual_out = norm.forward_for(block, x, residual)
    assert isinstance(row, UnnormalizedRow)
    got = block(row).float()
    normed, want_residual = norm(x, residual)
    assert torch.equal(residual_out, want_residual)
    want = block(normed).float()
    relative = float((got - want).norm() / want.norm())
    assert relative < 1e-2, relative


@pytest.mark.parametrize("num_tokens", [1, 16, 64, 256, 2048])
def test_one_program_routes_and_groups_as_the_torch_ops_do(num_tokens: int) -> None:
    """The router kernel and the one-program grouping (relaxed atomics, barriers) on the GPU,
    at Qwen3-30B-A3B's 128 experts, top 8."""
    logits = torch.randn(num_tokens, 128, device="cuda", generator=torch.Generator("cuda"))
    weights, ids = route(logits, 8, renormalize=True)
    fused_weights, fused_ids = route_fused(logits, 8, renormalize=True)
    assert torch.equal(fused_ids, ids)
    assert torch.allclose(fused_weights, weights, atol=1e-6)
    block_m = block_m_for(num_tokens * 8, 128)
    expected = align_rows(ids, 128, block_m)
    fused = align_rows_fused(ids, 128, block_m)
    assert torch.equal(fused[1], expected[1])
    assert torch.equal(by_run(*fused), by_run(*expected))
    if num_tokens <= ROUTE_IN_ALIGN_TOKENS:  # (a decode step: routed in the grouping kernel)
        routed = route_and_align_fused(logits, 8, True, block_m)
        assert torch.equal(routed[1], ids)
        assert torch.allclose(routed[0], weights, atol=1e-6)
        assert torch.equal(routed[3], expected[1])
        assert torch.equal(by_run(routed[2], routed[3]), by_run(*expected))


# The families the qkv GEMV's RoPE + cache write is checked on (heads of 128, 96, 256; a bias;
# q/k norms)
ROPE_FAMILIES = ["llama-3-8b", "qwen2.5-7b", "phi-3-mini", "gemma-2-9b", "qwen3-8b", "gemma-3-12b"]
FAMILIES = ["qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "phi-3-mini", "gemma-3-12b", "gemma-2-9b"]
# Gemma 2 9B's shape (not shipped): soft-capped attention and logits, a window every other layer
GEMMA2_9B = {
    "model_type": "gemma2",
    "vocab_size": 256000,
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    ("family", "num_prompts"),
    [
        *((family, 5) for family in FAMILIES),
        ("qwen3-30b-a3b", 1),
        ("mixtral-8x7b", 1),
    ],
)
def test_triton_path_with_graphs_equals_torch_path(
    family: str, num_prompts: int, tmp_path: Path
) -> None:
    """(Gemma: a 64-token window on the first layer, full attention on the second, so the
    prompts pass the window. Five prompts: decode steps of 5 replay the graph of 8, whose
    padding tokens an MoE layer must route to no expert; one prompt (the 300 tokens): decode
    steps of one token, an MoE layer's two GEMVs.)"""
    if family == "gemma-2-9b":
        config = dict(GEMMA2_9B)
    else:
        config = json.loads((CONFIGS / f"{family}.json").read_text())
    config["num_hidden_layers"] = 2
    if family.startswith("gemma"):
        config.update(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(3)
    vocab = int(config["vocab_size"])
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (7, 300, 64, 129, 33)]
    prompts = prompts if num_prompts == 5 else prompts[1:2]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("triton", "torch"):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            skip_tokenizer_init=True,
            num_blocks=256,
            max_model_len=512,
            max_num_batched_tokens=256,  # the 300-token prompt in two chunks
        )
        results[backend] = [o.outputs[0] for o in llm.generate(prompts, params)]
        if backend == "triton":
            assert llm.engine.runner.decode_graphs is not None
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    for ours, reference in zip(results["triton"], results["torch"], strict=True):
        assert ours.token_ids == reference.token_ids
        for a, b in zip(ours.logprobs or [], reference.logprobs or [], strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3


def _two_layers_of(family: str, folder: Path) -> None:
    """`family`'s shipped config (Gemma 2: `GEMMA2_9B`) at two layers into `folder`, for a
    batch-1 run through the one-row GEMVs (skipped below compute capability 9.0)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the one-row GEMV is launched dependent: compute capability 9.0")
    config = (
        dict(GEMMA2_9B)
        if family == "gemma-2-9b"
        else json.loads((CONFIGS / f"{family}.json").read_text())
    )
    config["num_hidden_layers"] = 2
    (folder / "config.json").write_text(json.dumps(config))


def _batch_one_either_way(
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    flag: tuple[object, str],
    values: tuple[object, object],
    seed: int,
    **settings: object,
) -> tuple[dict[object, list[Any]], dict[object, list[object]]]:
    """Prompts of 7, 150 and 600 tokens, 24 greedy tokens each with 2 logprobs, one at a time
    through `folder`'s model (bf16, dummy weights, a fresh engine for each value) with
    `flag` (module, name) set to each of `values`: ({value: [(tokens, their logprobs, the
    `bf16_agreement.Run` with each step's top 2)]}, {value:
    the (leave, raw token) arguments of each `decode_leaving_splits` call of the attention})."""
    from kvfleet.engine.attention import triton_attention

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in (7, 150, 600)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    calls: list[object] = []
    leaving = triton_attention.decode_leaving_splits
    monkeypatch.setattr(
        triton_attention,
        "decode_leaving_splits",
        lambda *args: calls.append(args[-2:]) or leaving(*args),
    )
    runs, seen = {}, {}
    for value in values:
        monkeypatch.setattr(*flag, value)
        calls.clear()
        llm = LLM(str(folder), load_format="dummy", device="cuda", dtype="bfloat16",
                  skip_tokenizer_init=True, num_blocks=256, max_model_len=1024,
                  max_num_batched_tokens=256, max_num_seqs=1, **settings)  # fmt: skip
        outputs = [llm.generate([p], params)[0] for p in prompts]
        runs[value] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []],
                        from_engine(o)) for o in outputs]  # fmt: skip
        seen[value] = list(calls)
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    return runs, seen


def _same_tokens(runs: list[Any], want: list[Any], bound: float) -> None:
    """Each prompt's tokens equal, its logprobs within `bound`."""
    for (tokens, logprobs, _), (want_tokens, want_logprobs, _) in zip(runs, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < bound


@pytest.mark.parametrize(
    ("family", "quantization"),
    [
        *((family, None) for family in ROPE_FAMILIES),
        ("llama-3-8b", "fp8"),
        ("qwen3-8b", "fp8"),
    ],
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_rope_in_the_qkv_gemv_keeps_batch_one_tokens(
    family: str,
    quantization: str | None,
    kv_cache_dtype: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch-1 decode in bf16 or FP8 weights (two layers of the shipped shape: Qwen2's qkv
    bias, Gemma 2's heads of 256 and its soft-caps, Qwen3's and Gemma 3's q/k norms) with each
    layer's RoPE and cache write made by its qkv GEMV (`triton_attention.ROTARY_IN_QKV`) and by
    the kernel after it: the same tokens and logprobs, bf16 and FP8 caches. Phi-3's heads of 96
    (halves of 48 lanes in the RoPE kernels' 64) rotate in its bf16 GEMV's 16-row programs, not
    in FP8 weights' 64-row ones (32 pairs: not in one head), which leave it to the kernel.
    (With q/k norms the GEMV's last program of a head sums its squares in its own layout, not
    the RoPE kernel's, which can move a q or k value by one bf16 step: logprobs within 1e-2,
    and within 0.1 under FP8 weights, whose inputs each layer rounds to e4m3 steps of 1/16,
    where a bf16 step can cross one; the interpreter checks the bits: test_triton_gemv.py,
    test_fp8_linear.py.)"""
    from kvfleet.engine.attention import triton_attention
    from kvfleet.engine.layers import linear
    from kvfleet.engine.layers.linear import Linear
    from kvfleet.engine.layers.quantization.fp8 import Fp8Linear

    _two_layers_of(family, tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in (7, 300, 64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    calls = []
    layer = Fp8Linear if quantization == "fp8" else Linear
    forward_rotated = layer.forward_rotated

    def rotated(*args: object) -> object:
        out = forward_rotated(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(layer, "forward_rotated", rotated)
    # (the splits merged by the attention kernel, both runs: left to o's GEMV, each split's
    # output is rounded to bf16 on its own, test_attention_splits_merged_by_the_o_gemv_...)
    monkeypatch.setattr(linear, "SPLITS_IN_GEMV", 0)
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(triton_attention, "ROTARY_IN_QKV", fused)
        calls.clear()
        llm = LLM(str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16",
                  quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                  skip_tokenizer_init=True, num_blocks=256,
                  max_model_len=512, max_num_batched_tokens=256, max_num_seqs=1)  # fmt: skip
        outputs = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        runs[fused] = [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outputs]
        assert any(calls) == (fused and not (family == "phi-3-mini" and quantization == "fp8"))
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    if not family.startswith(("qwen3", "gemma-3")):
        assert runs[True] == runs[False]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(
        runs[True], runs[False], strict=True
    ):
        assert tokens == want_tokens
        bound = 0.1 if quantization == "fp8" else 1e-2
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < bound


@pytest.mark.parametrize(
    ("family", "kv_cache_dtype"),
    [("llama-3-8b", "auto"), ("gemma-2-9b", "auto"), ("qwen3-30b-a3b", "auto"),
     ("gemma-2-9b", "fp8")],
)  # fmt: skip
def test_attention_splits_merged_by_the_o_gemv_keep_batch_one_tokens(
    family: str, kv_cache_dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch-1 decode (two layers of the shipped shape; Gemma 2's windows and soft-caps) with
    decode attention's splits left to the o projection's GEMV to merge (`SplitRows`,
    `linear.SPLITS_IN_GEMV`) and merged by the attention kernel: the same tokens, logprobs
    within 0.1 (each split's output rounded to bf16 before the merge, not the merged output
    after it: a bf16 step of the attention's output here and there, 0.029 and 0.045 apart at
    Llama-3-8B and Qwen3-30B-A3B on the H200; test_triton_cuda.py checks the merge itself
    against float32 attention: as close as the kernel's). Prompts
    of 7, 150 and 600 tokens under 16 splits: one split holding keys, three, and past four
    (the kernel merges: the GEMV reads its one row). Gemma 2 over an FP8 cache: its soft-caps
    keep the upcasting decode kernel (not the e4m3 one), which leaves its splits too."""
    from kvfleet.engine.layers import linear

    _two_layers_of(family, tmp_path)
    runs, seen = _batch_one_either_way(tmp_path, monkeypatch, (linear, "SPLITS_IN_GEMV"), (4, 0),
                                       6, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    assert any(leave for leave, _ in seen[4])
    assert not any(leave for leave, _ in seen[0])
    _same_tokens(runs[4], runs[0], 0.1)


@pytest.mark.parametrize("family", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_the_top_k_ranked_by_the_routers_gemv_keeps_batch_one_tokens(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch-1 decode (two layers of the shipped shape, CUDA graphs, launched dependent) with
    each layer's top k ranked by its router's GEMV (`triton_moe_gemv.RANKED_BY_ROUTER`: down's
    programs read their expert and first tile before their wait) and by each gate_up program:
    the same sums in the same order, so the same tokens and logprobs exactly; and at the
    real shape, the layer given the router's choices is the layer given its logits."""
    from kvfleet.engine.layers import triton_moe_gemv
    from kvfleet.engine.layers.triton_gemv import gemv
    from kvfleet.engine.layers.triton_route import Choices

    experts, top_k, hidden, _ = MOE_SHAPES[family]
    x, w13, w2, _ = _moe_layer(family, 1, seed=3)
    gate = torch.randn(experts, hidden, device="cuda").bfloat16() * hidden**-0.5
    for down_all in (True, False):
        choices = Choices.empty(top_k, True, x.device)
        logits = gemv(x, gate, choices=choices)
        want = one_token_moe(x, logits, w13, w2, top_k, True, down_all=down_all)
        assert torch.equal(one_token_moe(x, choices, w13, w2, top_k, True, down_all=down_all),
                           want)  # fmt: skip
    handed: list[tuple[bool, bool]] = []  # (the flag, whether the layer was given choices)
    layer = triton_moe_gemv.one_token_moe

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        handed.append((triton_moe_gemv.RANKED_BY_ROUTER, isinstance(args[1], Choices)))
        return layer(*args, **kwargs)

    monkeypatch.setattr(triton_moe_gemv, "one_token_moe", spy)
    _two_layers_of(family, tmp_path)
    flag = (triton_moe_gemv, "RANKED_BY_ROUTER")
    runs, _ = _batch_one_either_way(tmp_path, monkeypatch, flag, (True, False), 7)
    assert {on for on, ranked in handed if ranked} == {True}
    assert all(on == ranked for on, ranked in handed)
    _same_tokens(runs[True], runs[False], 1e-9)


class _Plans(dict[tuple[int, int], tuple[int, int, int, int]]):
    """A `TUNED_ONE_ROW` table that can key `_batch_one_either_way`'s runs."""

    __hash__ = object.__hash__  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("family", "tuned_rows"),
    [("phi-3-mini", {9216, 16384, 32064}), ("gemma-3-12b", {30720, 262208})],
)
def test_tuned_one_row_plans_keep_batch_one_tokens_up_to_near_ties(
    family: str, tuned_rows: set[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch-1 decode (two layers of the shipped shape) with the bf16 layers `TUNED_ONE_ROW`
    names (Phi-3's qkv, which rotates then in 8-row programs, gate_up and LM head; Gemma-3's
    gate_up and LM head) at their 8 x 1,024 plans and at the rules' 16 x 256: sums in another
    order, bf16 rounding apart. Dummy weights give flat distributions (logprobs near -6),
    where such rounding can swap two near-tied tokens: as vLLM checks bf16 paths, each prompt's
    tokens equal until they first differ, and there each run's token among the other's top 2
    within 0.05; the logprobs before it within 0.05."""
    from kvfleet.engine.layers import triton_gemv

    plans: list[tuple[int, tuple[int, int, int, int]]] = []
    planned = triton_gemv.one_row_plan

    def spy(n: int, *args: Any) -> tuple[int, int, int, int]:
        plans.append((n, planned(n, *args)))
        return plans[-1][1]

    monkeypatch.setattr(triton_gemv, "one_row_plan", spy)
    _two_layers_of(family, tmp_path)
    tuned, ruled = _Plans(triton_gemv.TUNED_ONE_ROW), _Plans()
    runs, _ = _batch_one_either_way(tmp_path, monkeypatch, (triton_gemv, "TUNED_ONE_ROW"),
                                    (tuned, ruled), 8)  # fmt: skip
    assert {n for n, plan in plans if plan == (8, 1024, 4, 3) and n > 4096} == tuned_rows
    for mine, want in zip(runs[tuned], runs[ruled], strict=True):
        difference = first_difference(mine[2], want[2], top=2)
        at = len(want[0]) if difference is None else difference[0]
        assert difference is None or difference[1] < 0.05, difference
        assert max(abs(a - b) for a, b in zip(mine[1][:at], want[1][:at], strict=True)) < 0.05


@pytest.mark.parametrize(("family", "takes_it"), [("llama-3-8b", True), ("gemma-2-9b", False)])
def test_attention_splits_merged_by_the_4_bit_o_gemv_keep_batch_one_tokens(
    family: str, takes_it: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch-1 decode under INT4 (RTN) weights with decode attention's splits left to the o
    projection's 4-bit GEMV to merge (`SplitRows`, `linear.SPLITS_IN_PACKED_GEMV`) and merged
    by the attention kernel: the same tokens, logprobs within 0.1 (as the bf16 GEMV's test).
    Gemma 2's heads of 256 are wider than a step of the 4-bit plan: not left."""
    from kvfleet.engine.layers import linear

    _two_layers_of(family, tmp_path)
    flag = (linear, "SPLITS_IN_PACKED_GEMV")
    runs, seen = _batch_one_either_way(tmp_path, monkeypatch, flag, (True, False), 8,
                                       quantization="rtn")  # fmt: skip
    assert any(leave for leave, _ in seen[True]) == takes_it
    assert not any(leave for leave, _ in seen[False])
    _same_tokens(runs[True], runs[False], 0.1)


@pytest.mark.parametrize(
    ("family", "takes_it"), [("llama-3-8b", True), ("gemma-2-9b", True), ("qwen3-8b", False)]
)
def test_the_token_made_in_decode_attention_keeps_batch_one_tokens(
    family: str, takes_it: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch-1 decode under INT4 (RTN) weights, whose GEMV does not rotate (two layers of the
    shipped shape; Gemma 2's heads of 256, soft-caps and windows) with this step's q, k and v
    made in decode attention from the qkv layer's plain row, q and k rotated there, k and v
    written into the cache there (`RawToken`, `triton_attention.TOKEN_IN_ATTENTION`), and by
    the RoPE kernel: the same tokens, logprobs within 1e-2. Prompts of 7, 150 and 600 tokens:
    the token in a split's first tile or a later one (written before the tiles are read
    back). Qwen3's q/k norms keep the RoPE kernel (slower in the attention)."""
    from kvfleet.engine.attention import triton_attention

    _two_layers_of(family, tmp_path)
    flag = (triton_attention, "TOKEN_IN_ATTENTION")
    runs, seen = _batch_one_either_way(tmp_path, monkeypatch, flag, (True, False), 7,
                                       quantization="rtn")  # fmt: skip
    assert any(raw is not None for _, raw in seen[True]) == takes_it
    assert all(raw is None for _, raw in seen[False])
    _same_tokens(runs[True], runs[False], 1e-2)
