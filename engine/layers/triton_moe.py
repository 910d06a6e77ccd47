"""The fused mixture-of-experts path in Triton: tokens grouped by expert, two grouped GEMMs.

Five launches per layer: the router's softmax and top k (one program per token); the step's
(token, choice) rows grouped by the expert they chose, each expert's run padded to a whole
number of BLOCK_M rows so every block of rows meets one expert's weights (one program); a
grouped GEMM for gate and up writing SiLU(gate) * up ([rows, inner], no gate_up intermediate);
a grouped GEMM for down, times each row's router weight; the sum of each token's rows. Nothing
reads the device's counts back to the host: the grids are sized for the worst case, and
blocks past the padded total return at once, so decode steps are captured in CUDA graphs.

The routing and the grouping: `triton_route`. References (torch, moe.py): `route`,
`align_rows` (a stable sort), `experts_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import cdiv, next_power_of_2
from kvfleet.engine.layers.triton_route import (
    ROUTE_IN_ALIGN_TOKENS,
    align_rows_fused,
    route_and_align_fused,
    route_fused,
)


@triton.jit
def _combine_kernel(
    rows_ptr,  # [num_tokens * TOP_K, hidden]: each choice's weighted expert output
    out_ptr,  # [num_tokens, hidden]
    hidden,
    valid_ptr,  # [1] int32: the step's real tokens (VALID)
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    VALID: tl.constexpr,  # the tokens past valid_ptr[0] (padding: no expert ran) get 0
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    token = tl.program_id(0).to(tl.int64)
    let_next_start(PDL)
    wait_for_previous(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    if VALID:
        mask = cols < tl.where(token < tl.load(valid_ptr), hidden, 0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < hidden)


@triton.jit
def _block_rows(
    sorted_rows_ptr, run_ends_ptr, num_rows, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr
):
    """This block's rows (masked past the expert's run), its expert (the runs ending at or
    before its first row, counted), and whether it lies past the padded total (no work)."""
    first = tl.program_id(0) * BLOCK_M
    experts = tl.arange(0, E_PAD)
    ends = tl.load(run_ends_ptr + experts, mask=experts < num_experts, other=0)
    past = first >= tl.max(ends, 0)
    done = tl.sum((ends <= first) & (experts < num_experts), 0)
    expert = tl.minimum(done, num_experts - 1).to(tl.int64)
    rows = tl.load(sorted_rows_ptr + first + tl.arange(0, BLOCK_M))
    return rows, rows < num_rows, expert, past


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w13_ptr,  # [E, 2 * inner, hidden]
    out_ptr,  # [num_rows, inner]: SiLU(gate) * up of each (token, choice) row
    sorted_rows_ptr,  # [max_padded] int32
    run_ends_ptr,  # [E] int32
    num_rows,
    num_experts,
    inner,
    hidden,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    let_next_start(PDL)
    wait_for_previous(PDL)  # (which expert, hence which weights, comes from the kernel before)
    rows, row_mask, expert, past = _block_rows(
        sorted_rows_ptr, run_ends_ptr, num_rows, num_experts, BLOCK_M, E_PAD
    )
    if past:
        return
    tokens = (rows // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inner
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w13_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inner * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        gate = tl.dot(a, tl.trans(g), gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, tl.trans(u), up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
        h.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _down_kernel(
    h_ptr,  # [num_rows, inner]
    w2_ptr,  # [E, hidden, inner]
    weights_ptr,  # [num_rows] float32: each row's router weight
    out_ptr,  # [num_rows, hidden]
    sorted_rows_ptr,
    run_ends_ptr,
    num_rows,
    num_experts,
    hidden,
    inner,
    stride_ht,
    stride_we,
    stride_wn,
    stride_ot,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    let_next_start(PDL)
    wait_for_previous(PDL)  # (which expert, hence which weights, comes from the kernel before)
    rows, row_mask, expert, past = _block_rows(
        sorted_rows_ptr, run_ends_ptr, num_rows, num_experts, BLOCK_M, E_PAD
    )
    if past:
        return
    rows = rows.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_ht + offs_k[None, :]
    w_ptrs = w2_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inner, BLOCK_K):
        k_mask = offs_k < inner - k
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & n_mask[None, :],
    )


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: about the rows each expert gets, 16 to 128."""
    per_expert = -(-num_rows // num_experts)
    return next((size for size in (16, 32, 64) if per_expert <= size), 128)


# (BLOCK_N, BLOCK_K, warps, stages) of both grouped GEMMs by BLOCK_M, from a sweep at
# Qwen3-30B-A3B's shapes on the H100 (bench/RESULTS.md): each within ~4% of the best tile
# found for 1 to 4,096 tokens.
GEMM_TILES = {16: (32, 128, 4, 4), 32: (64, 128, 4, 3), 64: (64, 64, 4, 3), 128: (128, 64, 8, 3)}


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    router_logits: torch.Tensor,  # [num_tokens, E]
    w13: torch.Tensor,  # [E, 2 * inner, hidden]
    w2: torch.Tensor,  # [E, hidden, inner]
    top_k: int,
    renormalize: bool,
    valid: torch.Tensor | None = None,  # [1] int32: the real tokens (below)
) -> torch.Tensor:  # [num_tokens, hidden]
    """The layer's experts for each token's top k: a step of at most ROUTE_IN_ALIGN_TOKENS
    tokens (decode) is routed inside the grouping kernel, a larger one by the routing kernel
    (a program per token) first. With `valid`, the tokens past valid[0] (a CUDA graph's
    padding) meet no expert and come out 0: their rows would otherwise stream experts no real
    token chose."""
    num_tokens = x.shape[0]
    if num_tokens == 0 or num_tokens > ROUTE_IN_ALIGN_TOKENS:
        weights, ids = route_fused(router_logits, top_k, renormalize)
        return fused_experts(x, w13, w2, weights, ids, valid)
    block_m = block_m_for(num_tokens * top_k, w2.shape[0])
    weights, _, sorted_rows, run_ends = route_and_align_fused(
        router_logits, top_k, renormalize, block_m, valid
    )
    return _grouped_experts(x, w13, w2, weights, sorted_rows, run_ends, top_k, block_m, valid)


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [E, 2 * inner, hidden]
    w2: torch.Tensor,  # [E, hidden, inner]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k]
    valid: torch.Tensor | None = None,  # [1] int32: the real tokens (`fused_moe`)
) -> torch.Tensor:  # [num_tokens, hidden]
    """The experts `ids` chose, weighted by `weights`, summed per token."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, _ = w2.shape
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    block_m = block_m_for(num_tokens * top_k, num_experts)
    sorted_rows, run_ends = align_rows_fused(ids, num_experts, block_m, valid)
    return _grouped_experts(x, w13, w2, weights, sorted_rows, run_ends, top_k, block_m, valid)


def _grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    sorted_rows: torch.Tensor,  # [max_padded] int32 (`align_rows`)
    run_ends: torch.Tensor,  # [E] int32
    top_k: int,
    block_m: int,
    valid: torch.Tensor | None,  # [1] int32: the real tokens (`fused_moe`)
) -> torch.Tensor:
    """The two grouped GEMMs over rows grouped by expert, then each token's sum."""
    num_tokens = x.shape[0]
    num_experts, hidden, inner = w2.shape
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1, "feature dims must be contiguous"
    num_rows = num_tokens * top_k
    num_blocks = sorted_rows.shape[0] // block_m
    block_n, block_k, warps, stages = GEMM_TILES[block_m]
    pdl = dependent_launch_args(x.device)
    tiles = {
        "E_PAD": next_power_of_2(num_experts),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        **pdl,
        "num_warps": warps,
        "num_stages": stages,
    }
    h = x.new_empty(num_rows, inner)
    _gate_up_kernel[(num_blocks, cdiv(inner, block_n))](
        x,
        w13,
        h,
        sorted_rows,
        run_ends,
        num_rows,
        num_experts,
        inner,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        TOP_K=top_k,
        **tiles,
    )
    rows_out = x.new_empty(num_rows, hidden)
    _down_kernel[(num_blocks, cdiv(hidden, block_n))](
        h,
        w2,
        weights.flatten().float(),
        rows_out,
        sorted_rows,
        run_ends,
        num_rows,
        num_experts,
        hidden,
        inner,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        rows_out.stride(0),
        **tiles,
    )
    out = x.new_empty(num_tokens, hidden)
    block = min(1024, next_power_of_2(hidden))
    _combine_kernel[(num_tokens, cdiv(hidden, block))](
        rows_out,
        out,
        hidden,
        valid if valid is not None else run_ends,
        TOP_K=top_k,
        BLOCK=block,
        VALID=valid is not None,
        **pdl,
    )
    return out
