"""The mixture of experts' routing in Triton: each token's softmax and top k (`route_fused`,
`top_k_rows` for one token inside the one-token GEMVs), and the step's (token, choice) rows
grouped by the expert they chose, each expert's run padded to whole blocks of BLOCK_M rows
(`align_rows_fused`), both in one launch for a decode step's few tokens
(`route_and_align_fused`). Used by the fused MoE path (`triton_moe`).

References (torch, moe.py): `route`, `align_rows` (a stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import next_power_of_2
from kvfleet.engine.layers.moe import max_padded_rows


@triton.jit
def route_rows(
    logits_ptr, weights_ptr, ids_ptr, tokens, token_ok, num_experts, stride_l,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
    CACHE: tl.constexpr = "",
):  # fmt: skip
    """`moe.route` for the tokens [T] (each row one token), the weights and ids stored
    (CACHE: the logits' loads' cache modifier)."""
    weights, ids = top_k_rows(logits_ptr, tokens, token_ok, num_experts, stride_l, TOP_K, K_PAD,
                              E_PAD, RENORMALIZE, CACHE)  # fmt: skip
    slots = tl.arange(0, K_PAD)[None, :]
    at = tokens[:, None] * TOP_K + slots
    ok = token_ok[:, None] & (slots < TOP_K)
    tl.store(weights_ptr + at, weights, mask=ok)
    tl.store(ids_ptr + at, ids, mask=ok)


@dataclass(frozen=True)
class Choices:
    """One token's top k as the router's one-row GEMV leaves them when it ranks its own logits
    (`triton_gemv.gemv(choices=...)`, `triton_moe_gemv.RANKED_BY_ROUTER`): `moe.route`'s
    weights [top_k] float32 and ids [top_k] int64."""

    weights: torch.Tensor
    ids: torch.Tensor
    renormalize: bool

    @classmethod
    def empty(cls, top_k: int, renormalize: bool, device: torch.device) -> Choices:
        weights = torch.empty(top_k, dtype=torch.float32, device=device)
        return cls(weights, torch.empty(top_k, dtype=torch.int64, device=device), renormalize)

    @property
    def top_k(self) -> int:
        return int(self.weights.shape[0])


# Experts a step of the one-token ranking (`top_k_rows`) compares each logit with
RANK_CHUNK = tl.constexpr(32)


@triton.jit
def top_k_rows(
    logits_ptr, tokens, token_ok, num_experts, stride_l,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
    CACHE: tl.constexpr = "",
):  # fmt: skip
    """`moe.route` for the tokens [T]: softmax in float32, the top k (highest first), rescaled:
    (weights [T, K_PAD] float32, ids [T, K_PAD] int64; slots past TOP_K 0). CACHE: the
    logits' loads' cache modifier (".cg": written by other programs of the same kernel).

    One token (a program a token, the one-token MoE GEMV): each expert's rank among the
    token's, how many logits are higher or equal at a lower index (the softmax keeps their
    order), counted against RANK_CHUNK logits at a time; the ranks below k are the choices, put
    in their slots by one sum. Several tokens (a decode step's, in the grouping kernel): a
    maximum and its lowest index a choice (a [T, E, RANK_CHUNK] comparison would not fit a
    program's registers). (The choices one after another took 16 cross-warp reductions,
    barrier after barrier, ahead of the one-token MoE GEMV's first weight load: sm_90 SASS,
    Qwen3-30B-A3B's gate_up, 60 barriers -> 22.)"""
    offs = tl.arange(0, E_PAD)[None, :]
    logits = tl.load(
        logits_ptr + tokens[:, None] * stride_l + offs,
        mask=token_ok[:, None] & (offs < num_experts),
        other=float("-inf"),
        cache_modifier=CACHE,
    ).to(tl.float32)
    if logits.shape[0] == 1:  # (ranked before the masking below: moved after it, the
        # sm_90 gate_up takes 80 registers, not the measured 72)
        rank = _ranks(logits, logits_ptr, tokens, token_ok, num_experts, stride_l, offs, CACHE)
    logits = tl.where(token_ok[:, None], logits, 0.0)  # (no -inf rows: no NaNs, not stored)
    probs = tl.exp(logits - tl.max(logits, 1)[:, None])
    probs = probs / tl.sum(probs, 1)[:, None]
    slots = tl.arange(0, K_PAD)[None, :]
    if logits.shape[0] == 1:
        chosen = rank[:, :, None] == slots[:, None, :]  # [1, E_PAD, K_PAD]: expert e in slot s
        weights = tl.sum(tl.where(chosen, probs[:, :, None], 0.0), 1)
        ids = tl.sum(tl.where(chosen, offs[:, :, None], 0), 1).to(tl.int64)
        weights = tl.where(slots < TOP_K, weights, 0.0)  # (ranks TOP_K to K_PAD: no slot)
        ids = tl.where(slots < TOP_K, ids, 0)
    else:
        weights = tl.zeros([probs.shape[0], K_PAD], dtype=tl.float32)
        ids = tl.zeros([probs.shape[0], K_PAD], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, 1)[:, None]
            chosen = tl.min(tl.where(probs == best, offs, E_PAD), 1)[:, None]
            weights = tl.where(slots == j, best, weights)
            ids = tl.where(slots == j, chosen, ids)
            probs = tl.where(offs == chosen, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    return weights, ids


@triton.jit
def _ranks(logits, logits_ptr, tokens, token_ok, num_experts, stride_l, offs,
           CACHE: tl.constexpr):  # fmt: skip
    """Each expert's place among its token's logits [T, E_PAD] (0 the highest; equal ones by
    index), from RANK_CHUNK of them loaded at a time."""
    rank = tl.zeros(logits.shape, dtype=tl.int32)
    chunk = tl.arange(0, RANK_CHUNK)[None, None, :]
    for c in tl.static_range(0, logits.shape[1], RANK_CHUNK):
        js = c + chunk
        other = tl.load(logits_ptr + tokens[:, None, None] * stride_l + js,
                        mask=token_ok[:, None, None] & (js < num_experts),
                        other=float("-inf"), cache_modifier=CACHE).to(tl.float32)  # fmt: skip
        mine = logits[:, :, None]
        above = (other > mine) | ((other == mine) & (js < offs[:, :, None]))
        rank += tl.sum(above.to(tl.int32), 2)
    return rank


@triton.jit
def _route_kernel(
    logits_ptr,  # [num_tokens, E]
    weights_ptr,  # [num_tokens, TOP_K] float32
    ids_ptr,  # [num_tokens, TOP_K] int64
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    """`moe.route` for one token."""
    token = tl.program_id(0) + tl.arange(0, 1)
    let_next_start(PDL)
    wait_for_previous(PDL)
    route_rows(
        logits_ptr, weights_ptr, ids_ptr, token, token >= 0, num_experts, stride_l,
        TOP_K, K_PAD, E_PAD, RENORMALIZE,
    )  # fmt: skip


def route_fused(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one kernel (one program per token)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    pdl = dependent_launch_args(router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits,
            weights,
            ids,
            num_experts,
            router_logits.stride(0),
            TOP_K=top_k,
            K_PAD=next_power_of_2(top_k),
            E_PAD=next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
            **pdl,
        )
    return weights, ids


@triton.jit
def _align_kernel(
    ids_ptr,  # [num_rows] expert of each (token, choice) row (ROUTE: written here first)
    sorted_rows_ptr,  # [max_padded] int32, out
    run_ends_ptr,  # [E] int32, out: the end of each expert's padded run
    scratch_ptr,  # [2, E_PAD] int32: rows per expert, then each run's start; rows placed
    logits_ptr,  # [num_tokens, E] (ROUTE)
    weights_ptr,  # [num_tokens, TOP_K] float32, out (ROUTE)
    num_rows,
    num_experts,
    max_padded,
    num_tokens,
    stride_l,
    valid_ptr,  # [1] int32: the step's real tokens (VALID)
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    VALID: tl.constexpr,  # only the rows of the first valid_ptr[0] tokens meet an expert
    ROUTE: tl.constexpr,  # route the (at most T_PAD) tokens first, in this program
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    """`align_rows` in one program (no sort): count each expert's rows, pad and place the runs,
    then drop each row at its run's start plus a slot taken atomically. The order of rows
    within a run is arbitrary; no row's result depends on it. (Atomics relaxed, scoped to the
    program: the barriers order them. On the H100 at 8 to 16k rows: 2-41 us.) ROUTE (a decode
    step's few tokens): `route` first, all tokens as one block, one launch fewer a layer."""
    let_next_start(PDL)
    wait_for_previous(PDL)
    if ROUTE:
        tokens = tl.arange(0, T_PAD)
        route_rows(
            logits_ptr, weights_ptr, ids_ptr, tokens, tokens < num_tokens, num_experts,
            stride_l, TOP_K, K_PAD, E_PAD, RENORMALIZE,
        )  # fmt: skip
        tl.debug_barrier()  # (the ids written, seen by every thread of the program)
    placed = num_rows  # (rows are token-major: a graph's padding tokens' rows come last)
    if VALID:
        placed = tl.minimum(num_rows, tl.load(valid_ptr) * TOP_K)
    experts = tl.arange(0, E_PAD)
    counts_ptr = scratch_ptr
    cursor_ptr = scratch_ptr + E_PAD
    tl.store(counts_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.store(cursor_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    ones = tl.full([CHUNK], 1, tl.int32)
    for start in range(0, placed, CHUNK):
        _, mask, ids = _chunk_of_ids(ids_ptr, start, placed, CHUNK)
        tl.atomic_add(counts_ptr + ids, ones, mask=mask, sem="relaxed", scope="cta")
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(run_ends_ptr + experts, ends, mask=experts < num_experts)
    tl.store(counts_ptr + experts, ends - padded)
    for start in range(0, max_padded, CHUNK):
        slots = start + tl.arange(0, CHUNK)
        none = tl.full([CHUNK], 0, tl.int32) + num_rows
        tl.store(sorted_rows_ptr + slots, none, mask=slots < max_padded)
    tl.debug_barrier()
    for start in range(0, placed, CHUNK):
        rows, mask, ids = _chunk_of_ids(ids_ptr, start, placed, CHUNK)
        slot = tl.atomic_add(cursor_ptr + ids, ones, mask=mask, sem="relaxed", scope="cta")
        run_start = tl.load(counts_ptr + ids, mask=mask, other=0)
        tl.store(sorted_rows_ptr + run_start + slot, rows, mask=mask)


@triton.jit
def _chunk_of_ids(ids_ptr, start, placed, CHUNK: tl.constexpr):
    """(rows, which of them are placed, their experts) of the CHUNK rows from `start`."""
    rows = start + tl.arange(0, CHUNK)
    mask = rows < placed
    return rows, mask, tl.load(ids_ptr + rows, mask=mask, other=0)


# Steps of at most this many tokens route inside the grouping kernel (`route_and_align_fused`;
# a power of two).
ROUTE_IN_ALIGN_TOKENS = 16


def align_rows_fused(
    ids: torch.Tensor, num_experts: int, block_m: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_rows` in one kernel launch (each run's rows in an arbitrary order); with `valid`
    ([1] int32), only the rows of the first valid[0] tokens."""
    sorted_rows, run_ends, _ = _align(ids, num_experts, block_m, None, valid)
    return sorted_rows, run_ends


def route_and_align_fused(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route` then `align_rows` in one launch, for at most ROUTE_IN_ALIGN_TOKENS tokens:
    (weights, ids, sorted rows, run ends)."""
    num_tokens, num_experts = router_logits.shape
    assert num_tokens <= ROUTE_IN_ALIGN_TOKENS
    device = router_logits.device
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    route = (router_logits, renormalize)
    sorted_rows, run_ends, weights = _align(ids, num_experts, block_m, route, valid)
    assert weights is not None
    return weights, ids, sorted_rows, run_ends


def _align(
    ids: torch.Tensor,  # [num_tokens, top_k]: read, or (route) written
    num_experts: int,
    block_m: int,
    route: tuple[torch.Tensor, bool] | None,  # (router logits, renormalize): route first
    valid: torch.Tensor | None,  # [1] int32: the real tokens (the rest: a graph's padding)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    num_tokens, top_k = ids.shape if ids.dim() == 2 else (ids.numel(), 1)
    num_rows = ids.numel()
    size = max_padded_rows(num_rows, num_experts, block_m)
    device = ids.device
    sorted_rows = torch.empty(size, dtype=torch.int32, device=device)
    run_ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    e_pad = next_power_of_2(num_experts)
    scratch = torch.empty(2, e_pad, dtype=torch.int32, device=device)
    weights = None
    logits = scratch  # (a stand-in, never read, unless routing)
    if route is not None:
        logits = route[0]
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    pdl = dependent_launch_args(device)
    _align_kernel[(1,)](
        ids,
        sorted_rows,
        run_ends,
        scratch,
        logits,
        weights if weights is not None else scratch,
        num_rows,
        num_experts,
        size,
        num_tokens,
        logits.stride(0),
        valid if valid is not None else scratch,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=256,
        VALID=valid is not None,
        ROUTE=route is not None,
        TOP_K=top_k,
        K_PAD=next_power_of_2(top_k),
        T_PAD=ROUTE_IN_ALIGN_TOKENS,  # (one compiled variant for any step)
        RENORMALIZE=route is not None and route[1],
        **pdl,
        num_warps=8,
    )
    return sorted_rows, run_ends, weights
