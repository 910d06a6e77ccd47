"""A one-token mixture-of-experts layer as two GEMVs in Triton (a batch-1 decode step).

With one token there is nothing to group: `triton_moe`'s grouping kernel and the sum of each
token's rows after down are fixed costs (on the H200 at Qwen3-30B-A3B's shape, 4.0 and 2.0 us a
layer against gate_up's 15.3 and down's 9.2; bench/RESULTS.md "2026-11-29 (session 29)"), and
its grouped GEMMs pad each expert's one row to a block of 16. Here, after the router's GEMV:

- gate_up: program (choice, block of inner rows) finds the token's top k from the router's
  logits itself (a softmax over E values, as every program of the layer can afford), then
  streams that expert's gate and up rows as `triton_gemv`'s GEMV does (a [BLOCK_N, BLOCK_K]
  float32 sum of products a step, reduced once) and writes SiLU(gate) * up [TOP_K, inner];
  the first block of each choice stores its router weight and expert.
- down, few experts chosen (`shipped_tiles`): program (block of hidden rows) loads the rows
  of all k experts each step and adds each times its h, scaled by its router weight, into one
  sum, so no combine kernel. Many chosen: split, program (block of hidden rows, choice)
  streams that expert's rows and scales the sum by its router weight; the last of a row
  block's k programs to finish adds the k parts in order (`triton_packed.split_k_store`).
  (One program a row block taking the k experts one after another kept too few bytes in
  flight: at Qwen3-30B-A3B's shape the layer took 56.5 us against the grouped kernels' 36.7.)

Two launches instead of four (route + group, gate_up, down, combine). The reference is the
same as `triton_moe`'s: `moe.route` then `moe.experts_reference`.
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
from kvfleet.engine.layers.linear import UnnormalizedRow
from kvfleet.engine.layers.quantization.triton_packed import shared_workspace, split_k_store
from kvfleet.engine.layers.triton_gemv_rows import norm_args, row_and_norm, row_values
from kvfleet.engine.layers.triton_layers import inverse_rms, summed_row
from kvfleet.engine.layers.triton_route import Choices, top_k_rows

# (BLOCK_N, BLOCK_K, warps) of the gate_up and the down GEMV, bf16/fp16 weights (a float32
# weight halves BLOCK_K: a tile holds the same bytes), and whether down takes all k experts in
# one program a row block (`_down_all_gemv_kernel`: each step loads every chosen expert's rows
# together, no partial sums through memory, no counters) or is split over them
# (`_down_gemv_kernel`), by the top k (`shipped_tiles`). Many small experts (Qwen3-30B-A3B, k 8
# of 128, inner 768): on the H200 a layer takes 40.5 us split, 46.6 over all k, and 3.28 ms
# against 3.69 at batch 1 end to end (bench/RESULTS.md session 32; (8, 128, 4) / (4, 256, 2)
# made the layer 1-2 us faster but batch 1 slower, session 30). Few large experts (Mixtral,
# k 2 of 8, inner 14336): 215.4 us split at the many-expert tiles, 184.2 over all k at
# (4, 512, 4) both. Since the one-token prologue and loop order (session 40): A3B 34.1 us a
# layer (main before: 39.3), Mixtral 174.1 (187.0); the other tiles no faster.
MANY_EXPERTS = ((8, 256, 4), (8, 256, 4), False)
# The token's top k ranked once, by the router's GEMV's last program (`triton_gemv.gemv(choices=
# ...)`), instead of by each gate_up program after its wait; gate_up's programs let down start
# only after their own wait (the router complete), so that down's programs, split over the k,
# read their expert and load its first tile while gate_up finishes (its weights' loads can
# start before its wait). Off: for an A/B run (bench/next/README.md: session 45's lead; down
# ranking the logits itself in each of its programs lost, A3B 2.637 -> 2.826 ms, call 86).
RANKED_BY_ROUTER = False
FEW_EXPERTS = ((4, 512, 4), (4, 512, 4), True)


def shipped_tiles(top_k: int) -> tuple[tuple[int, int, int], tuple[int, int, int], bool]:
    """(gate_up tiles, down tiles, down over all k) for a layer choosing `top_k` experts."""
    return FEW_EXPERTS if top_k <= 2 else MANY_EXPERTS


@triton.jit
def _expert_tiles(gate_ptrs, up_ptrs, ks, row_ok, hidden):
    """An expert's gate and up rows [BLOCK_N, BLOCK_K] at inputs ks (0 past hidden)."""
    ok = row_ok[:, None] & (ks < hidden)[None, :]
    gate = tl.load(gate_ptrs + ks[None, :], mask=ok, other=0.0)
    return gate, tl.load(up_ptrs + ks[None, :], mask=ok, other=0.0)


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,  # [hidden]
    logits_ptr,  # [E] the router's
    w13_ptr,  # [E, 2 * inner, hidden]
    h_ptr,  # [TOP_K, inner] out: SiLU(gate) * up of each choice
    weights_ptr,  # [TOP_K] float32 out: the router weights
    ids_ptr,  # [TOP_K] int64 out: the experts
    residual_ptr,  # [hidden] (NORM and HAS_RESIDUAL)
    norm_w_ptr,  # [hidden] the norm's weight (NORM)
    num_experts, inner, hidden, stride_we, eps,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, PDL: tl.constexpr,
    RANKED: tl.constexpr = False,
):  # fmt: skip
    """NORM: the token's row is RMSNorm(x + residual), made here as the router's GEMV made it
    (`triton_gemv_rows.row_values`). RANKED: the router's GEMV wrote the choices (weights_ptr,
    ids_ptr are inputs); the kernel after may start only once this one's programs have waited
    (the router then complete: the choices there for it to read before its own wait)."""
    choice = tl.program_id(0)
    pid_n = tl.program_id(1)
    if not RANKED:
        let_next_start(PDL)
    wait_for_previous(PDL)  # (the logits: which expert, hence which weights)
    # The expert first, then its first tiles' loads, and the row's norm while they come in.
    slots = tl.arange(0, K_PAD)[None, :]
    mine = slots == choice
    if RANKED:
        let_next_start(PDL)
        expert = tl.load(ids_ptr + choice, cache_modifier=".cg")
    else:
        token = tl.arange(0, 1)
        weights, ids = top_k_rows(
            logits_ptr, token, token >= 0, num_experts, 0, TOP_K, K_PAD, E_PAD, RENORMALIZE
        )
        expert = tl.sum(tl.sum(tl.where(mine, ids, 0), 1), 0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < inner
    offsets = tl.arange(0, BLOCK_K)
    gate_ptrs = w13_ptr + expert * stride_we + rows[:, None] * hidden
    up_ptrs = gate_ptrs + inner * hidden
    w_gate, w_up = _expert_tiles(gate_ptrs, up_ptrs, offsets, row_ok, hidden)
    inv_rms = 1.0
    if NORM:
        row = tl.arange(0, ROW_BLOCK)
        inv_rms = inverse_rms(summed_row(x_ptr, residual_ptr, row, row < hidden, HAS_RESIDUAL),
                              hidden, eps)  # fmt: skip
    if pid_n == 0 and not RANKED:
        tl.store(weights_ptr + slots, weights, mask=mine)
        tl.store(ids_ptr + slots, ids, mask=mine)
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        ks = k + offsets
        if k > 0:  # (the first tiles are loaded above)
            w_gate, w_up = _expert_tiles(gate_ptrs, up_ptrs, ks, row_ok, hidden)
        x = row_values(x_ptr, ks, hidden, residual_ptr, norm_w_ptr, inv_rms, NORM, HAS_RESIDUAL,
                       OFFSET).to(tl.float32)[None, :]  # fmt: skip
        gate += w_gate.to(tl.float32) * x
        up += w_up.to(tl.float32) * x
    g = tl.sum(gate, 1)
    h = g / (1.0 + tl.exp(-g)) * tl.sum(up, 1)
    tl.store(h_ptr + choice * inner + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _down_tile(w_ptrs, ks, row_ok, inner):
    """An expert's down rows [BLOCK_N, BLOCK_K] at inputs ks (0 past inner)."""
    return tl.load(w_ptrs + ks[None, :], mask=row_ok[:, None] & (ks < inner)[None, :], other=0.0)


@triton.jit
def _down_gemv_kernel(
    h_ptr,  # [TOP_K, inner]
    w2_ptr,  # [E, hidden, inner]
    weights_ptr,  # [TOP_K] float32
    ids_ptr,  # [TOP_K] int64
    partial_ptr,  # [TOP_K, hidden] float32
    count_ptr,  # [cdiv(hidden, BLOCK_N)] int32
    out_ptr,  # [hidden]
    hidden, inner, stride_we,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    RANKED: tl.constexpr = False,
):  # fmt: skip
    """Program (block of hidden rows, choice): that expert's rows times its h, scaled by its
    router weight; the last of the TOP_K programs of a row block adds them in order. RANKED:
    the choices are the router's (complete when this kernel starts: `_gate_up_gemv_kernel`),
    read with the first tile's weights before the wait."""
    pid_n = tl.program_id(0)
    choice = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    offsets = tl.arange(0, BLOCK_K)
    let_next_start(PDL)
    if RANKED:  # (the router complete: its choices read as it left them, in L2)
        expert = tl.load(ids_ptr + choice, cache_modifier=".cg")
        weight = tl.load(weights_ptr + choice, cache_modifier=".cg")
    else:
        wait_for_previous(PDL)  # (the experts and h, from the gate_up GEMV)
        expert = tl.load(ids_ptr + choice)
        weight = tl.load(weights_ptr + choice)
    w_ptrs = w2_ptr + expert * stride_we + rows[:, None] * inner
    if RANKED:
        w = _down_tile(w_ptrs, offsets, row_ok, inner)
        wait_for_previous(PDL)  # (h, from the gate_up GEMV)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, inner, BLOCK_K):
        ks = k + offsets
        k_ok = ks < inner
        # (the weights' load first: h's waits on a layout exchange through shared memory)
        if not RANKED or k > 0:  # (RANKED: the first tile is loaded above)
            w = _down_tile(w_ptrs, ks, row_ok, inner)
        h = tl.load(h_ptr + choice * inner + ks, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * h[None, :]
    part = tl.sum(acc, 1) * weight
    split_k_store(part, 0.0, partial_ptr, count_ptr, out_ptr, rows, row_ok, pid_n, hidden,
                  choice, TOP_K)  # fmt: skip


@triton.jit
def _down_all_gemv_kernel(
    h_ptr,  # [TOP_K, inner]
    w2_ptr,  # [E, hidden, inner]
    weights_ptr,  # [TOP_K] float32
    ids_ptr,  # [TOP_K] int64
    out_ptr,  # [hidden]
    hidden, inner, stride_we,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (block of hidden rows): a step loads these rows of every chosen expert (the k
    tiles' loads issued together) and adds each times its h scaled by its router weight into
    one [BLOCK_N, BLOCK_K] float32 sum: out = sum over k of weight_c * (W_c . h_c), with the
    weight taken into h (the offsets from each expert's first row int32, shared by the k
    tiles: a tile of 64-bit pointers per expert would take the registers of four)."""
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    offsets = tl.arange(0, BLOCK_K)
    let_next_start(PDL)
    wait_for_previous(PDL)  # (the experts and h, from the gate_up GEMV)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, inner, BLOCK_K):
        ks = k + offsets
        k_ok = ks < inner
        tile = rows[:, None] * inner + ks[None, :]
        ok = row_ok[:, None] & k_ok[None, :]
        for choice in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + choice)
            weight = tl.load(weights_ptr + choice)
            w = tl.load(w2_ptr + expert * stride_we + tile, mask=ok, other=0.0)
            h = tl.load(h_ptr + choice * inner + ks, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * (h * weight)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=row_ok)


def one_token_moe(
    x: torch.Tensor | UnnormalizedRow,  # [1, hidden]
    router_logits: torch.Tensor | Choices,  # [1, E], or the top k the router's GEMV ranked
    w13: torch.Tensor,  # [E, 2 * inner, hidden]
    w2: torch.Tensor,  # [E, hidden, inner]
    top_k: int,
    renormalize: bool,
    tiles: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None,
    down_all: bool | None = None,
) -> torch.Tensor:  # [1, hidden]
    """`moe.route` then `moe.experts_reference` for one token, in two kernels; `tiles`
    (gate_up, down) and `down_all` other than `shipped_tiles` (bench/moe_layer.py). An
    `UnnormalizedRow`: the token is its RMSNorm, made by the gate_up GEMV as by the router's
    (which wrote x + residual: `router_logits` must come from it). `Choices`: the router's GEMV
    ranked its logits (`RANKED_BY_ROUTER`): no program here ranks them, and down's programs
    (split over the k) read their expert and its first tile before their wait."""
    x, norm = row_and_norm(x)
    num_experts, hidden, inner = w2.shape
    assert x.shape == (1, hidden)
    assert x.is_contiguous()
    ranked = isinstance(router_logits, Choices)
    if isinstance(router_logits, Choices):
        assert (router_logits.top_k, router_logits.renormalize) == (top_k, renormalize)
        weights, ids = router_logits.weights, router_logits.ids
        logits = weights  # (not read)
    else:
        assert router_logits.shape == (1, num_experts)
        assert router_logits.is_contiguous()
        logits = router_logits
        weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(top_k, dtype=torch.int64, device=x.device)
    assert w13.stride()[1:] == (hidden, 1), "each expert's rows contiguous"
    assert w2.stride()[1:] == (inner, 1), "each expert's rows contiguous"
    device = x.device
    h = x.new_empty(top_k, inner)
    pdl = dependent_launch_args(device)
    wide = 2 if x.element_size() > 2 else 1  # (float32: half the inputs a tile)
    shipped_gate_up, shipped_down, shipped_all = shipped_tiles(top_k)
    down_all = shipped_all if down_all is None else down_all
    gate_up_tiles, down_tiles = tiles or (shipped_gate_up, shipped_down)
    block_n, block_k, warps = gate_up_tiles
    residual, norm_weight, _ = norm_args(norm, x)
    _gate_up_gemv_kernel[(top_k, cdiv(inner, block_n))](
        x, logits, w13, h, weights, ids, residual, norm_weight, num_experts, inner, hidden,
        w13.stride(0), norm.eps if norm is not None else 0.0, TOP_K=top_k,
        K_PAD=next_power_of_2(top_k), E_PAD=next_power_of_2(num_experts),
        RENORMALIZE=renormalize, BLOCK_N=block_n, BLOCK_K=block_k // wide,
        ROW_BLOCK=next_power_of_2(hidden) if norm is not None else 1, NORM=norm is not None,
        HAS_RESIDUAL=norm is not None and norm.residual is not None,
        OFFSET=norm is not None and norm.offset, **pdl, num_warps=warps, RANKED=ranked,
    )  # fmt: skip
    out = torch.empty_like(x)
    block_n, block_k, warps = down_tiles
    if down_all:
        _down_all_gemv_kernel[(cdiv(hidden, block_n),)](
            h, w2, weights, ids, out, hidden, inner, w2.stride(0), TOP_K=top_k,
            BLOCK_N=block_n, BLOCK_K=block_k // wide, **pdl, num_warps=warps,
        )  # fmt: skip
        return out
    space = shared_workspace(device, top_k * hidden, cdiv(hidden, block_n))
    _down_gemv_kernel[(cdiv(hidden, block_n), top_k)](
        h, w2, weights, ids, space.partials, space.counters, out, hidden, inner, w2.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k // wide, **pdl, num_warps=warps,
        RANKED=ranked,
    )  # fmt: skip
    return out
