"""The fused mixture-of-experts kernels against the torch reference (TRITON_INTERPRET on CPU).

float32: within 1e-5 of `experts_reference`; float16: within 2e-3 (the kernels round SiLU * up
once, to the model dtype, as the reference does).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.layers.moe import align_rows, experts_reference, max_padded_rows, route
from kvfleet.engine.layers.triton_moe import block_m_for, fused_experts, fused_moe
from kvfleet.engine.layers.triton_moe_gemv import one_token_moe
from kvfleet.engine.layers.triton_route import (
    ROUTE_IN_ALIGN_TOKENS,
    align_rows_fused,
    route_and_align_fused,
    route_fused,
)


def by_run(sorted_rows: torch.Tensor, run_ends: torch.Tensor) -> torch.Tensor:
    """The grouped rows with each expert's run sorted (the fused grouping orders a run's
    rows as its atomics fall)."""
    place = torch.arange(sorted_rows.numel(), device=sorted_rows.device)
    run = torch.searchsorted(run_ends, place, right=True)  # past the last run: E
    keys = run * (int(sorted_rows.max()) + 1) + sorted_rows
    return sorted_rows[keys.argsort(stable=True)]


def test_rows_are_grouped_by_expert_in_whole_blocks() -> None:
    """Exact layout for a hand-made choice: each expert's rows in order, padded with the row
    count to 4; each expert's run end (an unchosen expert's run is empty); padding after."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # rows 0..5: experts 2,0,2,1,0,2
    sorted_rows, run_ends = align_rows(ids, num_experts=4, block_m=4)
    none = 6
    assert sorted_rows.tolist()[:12] == [1, 4, none, none, 3, none, none, none, 0, 2, 5, none]
    assert set(sorted_rows.tolist()[12:]) <= {none}
    assert run_ends.tolist() == [4, 8, 12, 12]
    assert len(sorted_rows) == max_padded_rows(6, 4, 4)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inner"),
    [
        (1, 8, 2, 64, 32),  # a decode step: two experts of eight, most blocks empty
        (37, 16, 4, 96, 80),  # features not multiples of the 64-wide tiles
        (300, 4, 2, 32, 64),  # ~150 rows per expert: blocks of 128 rows
        (3, 8, 8, 32, 32),  # every expert chosen by every token
    ],
)
def test_fused_experts_match_reference(
    dtype: torch.dtype,
    tolerance: float,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inner: int,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inner, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inner, generator=gen) / inner**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = route(logits, top_k, renormalize=num_experts != 4)
    expected = experts_reference(x, w13, w2, weights, ids)
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    assert (out.float() - expected.float()).abs().max() < tolerance
    if num_tokens == 300:
        assert block_m_for(num_tokens * top_k, num_experts) == 128


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(1, 8, 2, 16), (37, 16, 4, 16), (300, 4, 2, 64), (600, 128, 8, 16), (5, 6, 3, 32)],
)
def test_one_kernel_routes_and_groups_as_the_torch_ops_do(
    num_tokens: int, num_experts: int, top_k: int, block_m: int
) -> None:
    """The fused router picks the same experts with the same weights; the one-program
    grouping gives each expert's run the reference's rows (in any order within the run), the
    same run ends and padding."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(7))
    for renormalize in (False, True):
        weights, ids = route(logits, top_k, renormalize)
        fused_weights, fused_ids = route_fused(logits, top_k, renormalize)
        assert torch.equal(fused_ids, ids)
        assert torch.allclose(fused_weights, weights, atol=1e-6)
    expected = align_rows(ids, num_experts, block_m)
    fused = align_rows_fused(ids, num_experts, block_m)
    assert torch.equal(fused[1], expected[1])
    assert torch.equal(by_run(*fused), by_run(*expected))


def test_router_renormalizes_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights[0], probs[:2])
    weights, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(weights[0], probs[:2] / probs[:2].sum())


@pytest.mark.parametrize("num_experts", [8, 128])
def test_equal_logits_go_to_the_lower_expert_in_both_router_forms(num_experts: int) -> None:
    """Router logits with ties (bf16 rounds logits together): both ways the kernels choose,
    the one-token ranking (`route_fused`, a program a token) and the choices one after another
    (a decode step's tokens in the grouping kernel), take the experts a stable descending sort
    gives, the lower expert first among equal logits; weights as `route`'s."""
    logits = torch.randint(0, 5, (6, num_experts), generator=torch.Generator().manual_seed(3))
    logits = logits.float()
    top_k = 4
    want = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    for renormalize in (False, True):
        weights, _ = route(logits, top_k, renormalize)
        one_token = route_fused(logits, top_k, renormalize)
        in_grouping = route_and_align_fused(logits, top_k, renormalize, 16)[:2]
        for fused_weights, fused_ids in (one_token, in_grouping):
            assert torch.equal(fused_ids, want)
            assert torch.allclose(fused_weights, weights, atol=1e-6)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"), [(1, 128, 8), (5, 6, 3), (16, 8, 2)]
)
def test_routing_inside_the_grouping_kernel_equals_the_two(
    num_tokens: int, num_experts: int, top_k: int
) -> None:
    """A decode step's few tokens routed in the grouping kernel's one program: the experts and
    weights of `route`, then `align_rows`'s runs (rows in any order within a run)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(9))
    block_m = block_m_for(num_tokens * top_k, num_experts)
    for renormalize in (False, True):
        weights, ids = route(logits, top_k, renormalize)
        fused = route_and_align_fused(logits, top_k, renormalize, block_m)
        assert torch.equal(fused[1], ids)
        assert torch.allclose(fused[0], weights, atol=1e-6)
        expected = align_rows(ids, num_experts, block_m)
        assert torch.equal(fused[3], expected[1])
        assert torch.equal(by_run(fused[2], fused[3]), by_run(*expected))


@pytest.mark.parametrize("num_tokens", [1, ROUTE_IN_ALIGN_TOKENS, ROUTE_IN_ALIGN_TOKENS + 1])
def test_the_layer_path_matches_the_reference_either_side_of_the_routing_switch(
    num_tokens: int,
) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_tokens, 32, generator=gen)
    w13 = torch.randn(8, 2 * 24, 32, generator=gen) / 32**0.5
    w2 = torch.randn(8, 32, 24, generator=gen) / 24**0.5
    logits = torch.randn(num_tokens, 8, generator=gen)
    weights, ids = route(logits, 2, renormalize=True)
    expected = experts_reference(x, w13, w2, weights, ids)
    out = fused_moe(x, logits, w13, w2, 2, renormalize=True)
    assert (out - expected).abs().max() < 1e-5


@pytest.mark.parametrize("num_tokens", [6, ROUTE_IN_ALIGN_TOKENS + 24])
def test_a_graphs_padding_tokens_meet_no_expert_and_come_out_zero(num_tokens: int) -> None:
    """With `valid` (a CUDA graph's count of a step's real tokens), the tokens after the first
    valid[0] are grouped into no expert's run — the runs are those of the real tokens alone,
    so no expert only padding chose is streamed — and their outputs are 0; the real tokens'
    outputs are the reference's. (Either side of the routing switch.)"""
    gen = torch.Generator().manual_seed(13)
    num_experts, top_k, real = 16, 2, 4
    x = torch.randn(num_tokens, 32, generator=gen)
    w13 = torch.randn(num_experts, 2 * 24, 32, generator=gen) / 32**0.5
    w2 = torch.randn(num_experts, 32, 24, generator=gen) / 24**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:real, 8:] -= 100.0  # (the real tokens choose among experts 0-7 ...)
    logits[real:, :8] -= 100.0  # (... the padding among 8-15)
    valid = torch.tensor([real], dtype=torch.int32)
    weights, ids = route(logits[:real], top_k, renormalize=True)
    block_m = block_m_for(num_tokens * top_k, num_experts)
    runs = align_rows(ids, num_experts, block_m)[1]
    assert runs[7] == runs[-1]  # (experts 8-15: empty runs)
    all_ids = route(logits, top_k, renormalize=True)[1]
    assert torch.equal(align_rows_fused(all_ids, num_experts, block_m, valid)[1], runs)
    if num_tokens <= ROUTE_IN_ALIGN_TOKENS:
        routed = route_and_align_fused(logits, top_k, True, block_m, valid)
        assert torch.equal(routed[3], runs)
    out = fused_moe(x, logits, w13, w2, top_k, renormalize=True, valid=valid)
    expected = experts_reference(x[:real], w13, w2, weights, ids)
    assert (out[:real] - expected).abs().max() < 1e-5
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "hidden", "inner"),
    [
        (8, 2, 272, 84),  # inner not a multiple of the 8-row blocks; hidden: several steps
        (4, 2, 40, 136),  # float32: down's inputs in several steps
        (128, 8, 64, 24),  # Qwen3-MoE's routing
        (6, 6, 40, 16),  # every expert chosen
    ],
)
@pytest.mark.parametrize("down_all", [True, False])
def test_one_tokens_layer_as_two_gemvs_matches_the_reference(
    dtype: torch.dtype,
    tolerance: float,
    num_experts: int,
    top_k: int,
    hidden: int,
    inner: int,
    down_all: bool,
) -> None:
    """A batch-1 step: the top k found by each gate_up program from the router's logits, the
    experts' SiLU(gate) * up, then down over all k experts in one program a row block, or split
    over them (the last of each row block's programs adding their weighted parts): the
    reference's output, renormalized or not, the split counters back at zero."""
    from kvfleet.engine.layers.quantization.triton_packed import shared_workspace

    gen = torch.Generator().manual_seed(hidden + top_k)
    x = torch.randn(1, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inner, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inner, generator=gen) / inner**0.5).to(dtype)
    logits = torch.randn(1, num_experts, generator=gen).to(dtype)
    for renormalize in (False, True):
        weights, ids = route(logits, top_k, renormalize)
        expected = experts_reference(x, w13, w2, weights, ids)
        out = one_token_moe(x, logits, w13, w2, top_k, renormalize, down_all=down_all)
        assert out.dtype == dtype
        assert (out.float() - expected.float()).abs().max() < tolerance
        assert not shared_workspace(out.device, 0, 0).counters.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("with_residual", "offset"), [(True, False), (False, False), (True, True)])
def test_one_tokens_gemvs_normalize_the_row_as_the_norm_kernel_does(
    dtype: torch.dtype, with_residual: bool, offset: bool
) -> None:
    """An `UnnormalizedRow` through the router's GEMV and the two expert GEMVs gives, bit for
    bit, the layer of `triton_layers.add_rms_norm`'s output, and x + residual is written."""
    from kvfleet.engine.layers import triton_layers
    from kvfleet.engine.layers.triton_gemv import gemv
    from tests.unit.engine.triton.test_triton_gemv import _unnormalized_row

    row = _unnormalized_row(dtype, with_residual, offset, seed=5)
    gen = torch.Generator().manual_seed(6)
    num_experts, top_k, inner = 16, 4, 24
    gate = (torch.randn(num_experts, 200, generator=gen) * 0.1).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inner, 200, generator=gen) / 200**0.5).to(dtype)
    w2 = (torch.randn(num_experts, 200, inner, generator=gen) / inner**0.5).to(dtype)
    normed, residual = triton_layers.add_rms_norm(row.x, row.residual, row.weight, row.eps, offset)
    want = one_token_moe(normed, gemv(normed, gate), w13, w2, top_k, True)
    logits = gemv(row, gate)
    assert torch.equal(logits, gemv(normed, gate))
    assert torch.equal(one_token_moe(row, logits, w13, w2, top_k, True), want)
    assert torch.equal(row.residual_out, residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "tiles"),
    [
        (128, 8, (16, 64, 4, 1)),  # Qwen3-MoE's routing over 8 programs: the last one ranks
        (8, 2, None),  # Mixtral's, one program
        (6, 6, (4, 32, 1, 1)),  # every expert chosen, a part-filled last program
    ],
)
def test_the_routers_gemv_ranks_its_logits_into_the_choices(
    dtype: torch.dtype, num_experts: int, top_k: int, tiles: tuple[int, int, int, int] | None
) -> None:
    """`gemv(choices=...)`: the logits as without, and the last of its programs to store its
    rows ranks them all into `moe.route`'s top k (renormalized or not), its counter back at 0."""
    from kvfleet.engine.layers.quantization.triton_packed import shared_workspace
    from kvfleet.engine.layers.triton_gemv import gemv
    from kvfleet.engine.layers.triton_route import Choices

    gen = torch.Generator().manual_seed(num_experts + top_k)
    gate = (torch.randn(num_experts, 96, generator=gen) * 0.3).to(dtype)
    for renormalize in (False, True, False):  # (each a row of its own: a program ranking
        # before the others stored theirs would find the last row's logits)
        x = torch.randn(1, 96, generator=gen).to(dtype)
        choices = Choices.empty(top_k, renormalize, x.device)
        logits = gemv(x, gate, tiles=tiles, choices=choices)
        assert torch.equal(logits, gemv(x, gate, tiles=tiles))
        weights, ids = route(logits, top_k, renormalize)
        assert torch.equal(choices.ids, ids[0])
        torch.testing.assert_close(choices.weights, weights[0], rtol=1e-6, atol=1e-7)
        assert not shared_workspace(x.device, 0, 0).counters.any()


@pytest.mark.parametrize("down_all", [True, False])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "hidden", "inner"), [(128, 8, 64, 24), (8, 2, 272, 84)]
)
def test_one_tokens_layer_takes_the_choices_the_routers_gemv_ranked(
    num_experts: int, top_k: int, hidden: int, inner: int, down_all: bool
) -> None:
    """`one_token_moe` given the router GEMV's `Choices` (`RANKED_BY_ROUTER`: down's split
    programs read their expert and first tile before their wait): bit for bit the layer
    that ranks the logits in gate_up, within 2e-3 of the reference."""
    from kvfleet.engine.layers.triton_gemv import gemv
    from kvfleet.engine.layers.triton_route import Choices

    gen = torch.Generator().manual_seed(hidden + top_k)
    x = torch.randn(1, hidden, generator=gen).to(torch.float16)
    gate = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(torch.float16)
    w13 = (torch.randn(num_experts, 2 * inner, hidden, generator=gen) / hidden**0.5).half()
    w2 = (torch.randn(num_experts, hidden, inner, generator=gen) / inner**0.5).half()
    for renormalize in (False, True):
        choices = Choices.empty(top_k, renormalize, x.device)
        logits = gemv(x, gate, choices=choices)
        want = one_token_moe(x, logits, w13, w2, top_k, renormalize, down_all=down_all)
        out = one_token_moe(x, choices, w13, w2, top_k, renormalize, down_all=down_all)
        assert torch.equal(out, want)
        weights, ids = route(logits, top_k, renormalize)
        expected = experts_reference(x, w13, w2, weights, ids)
        assert (out.float() - expected.float()).abs().max() < 2e-3


@pytest.mark.parametrize("ranked", [False, True])
def test_the_moe_blocks_one_token_path_ranks_in_the_router_where_asked(
    ranked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SparseMoeBlock` given an `UnnormalizedRow` (one token, fused): with
    `RANKED_BY_ROUTER` on, its router's GEMV ranks (the block hands `Choices` on), and the
    output and x + residual are those of the layer ranking in gate_up, bit for bit."""
    from kvfleet.engine.layers import triton_moe_gemv
    from kvfleet.engine.layers.moe import SparseMoeBlock
    from kvfleet.engine.layers.triton_route import Choices
    from tests.unit.engine.triton.test_triton_gemv import _unnormalized_row

    block = SparseMoeBlock(16, 200, 24, 4, True, fused=True)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in (block.gate.weight, block.w13, block.w2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    runs = []
    handed: list[object] = []  # (the router's output each layer call was given)
    real = triton_moe_gemv.one_token_moe

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        handed.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_moe_gemv, "one_token_moe", spy)
    for on in (False, ranked):
        monkeypatch.setattr(triton_moe_gemv, "RANKED_BY_ROUTER", on)
        row = _unnormalized_row(torch.float32, True, False, seed=5)
        runs.append((block(row), row.residual_out))
        assert isinstance(handed[-1], Choices) == on
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
