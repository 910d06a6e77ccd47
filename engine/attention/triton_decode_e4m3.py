"""Decode attention over an FP8 cache with e4m3 products: no K or V value upcast.

`triton_decode`'s kernel upcasts every K and V value of an FP8 cache to float16 in registers
before its two products; for a GQA group of 4 query heads those conversions take about as long
as the tile's bytes take to arrive, so the kernel streams at its floor alone but loses 3-17% of
it in a serving step, with the SM clock and its neighbours (bench/RESULTS.md "2026-11-30
(session 38)"). Here the operands are swapped, as FlashInfer's decode does for small groups:
the tile's keys [BLOCK_N, D] and its token-minor values [D, BLOCK_N] (`cache_views`) are the
products' wide side as they lie in the cache (e4m3, contiguous along the product's inner
dimension, as an 8-bit operand must be), and the group's queries and softmax weights the narrow
side, quantized to e4m3 here: each query head by its own largest magnitude (vLLM's FlashAttention-3
path over an FP8 cache quantizes the query too, with one scale), the weights (at most 1)
times 448. Scores S^T [BLOCK_N, heads] = K . q^T, outputs O^T [D, heads] = V^T . P^T; the
softmax runs down the tokens. The sums of P are taken of the weights as quantized, so that
each head's weights still add up to one.

E4M3 False keeps the same program with float32 products (the Triton interpreter has no e4m3
products): the CPU tests check the swapped layout, the softmax and the splits with it; the
GPU tests the e4m3 products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.attention.triton_e4m3 import (
    E4M3_MAX,
    e4m3_kv_operands,
    e4m3_rows,
    takes_e4m3,
)
from kvfleet.engine.attention.triton_splits import (
    finish_split,
    group_heads,
    live_splits,
    program_split,
)
from kvfleet.engine.attention.triton_tiles import LOG2E, kv_tile_tokens, tile_positions
from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import next_power_of_2
from kvfleet.engine.layers.launch_cache import CachedKernel


@triton.jit
def _query_columns(q_ptr, seq, heads, offs_d, g_mask, d_mask, stride_qt, stride_qh,
                   E4M3: tl.constexpr):  # fmt: skip
    """The group's queries as the products' narrow side q^T [BLOCK_D, GROUP_PAD] (`e4m3_rows`:
    each head divided by its scale) and each head's scale [GROUP_PAD]."""
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    rows, q_scale = e4m3_rows(q, E4M3)
    return tl.trans(rows), q_scale


# NOTE: the block table's width changes step to step: one compiled kernel for any width.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_e4m3_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # head-major e4m3 blocks (`cache_views`): [block, slot, head, dim] strided
    v_cache_ptr,  # token-minor: one head's [head_dim, block_size] a run
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32: KV length including this step's token
    acc_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32: unnormalized P·V
    max_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32
    sum_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32
    count_ptr,  # [num_seqs * num_kv_heads] int32, zero between launches (MERGE)
    out_ptr,  # [num_seqs, num_heads, head_dim]
    kv_scales_ptr,  # [2] float32: the cache's K and V scales
    scale,
    sliding_window,  # 0: none
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_bt,
    stride_ot, stride_oh, num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MERGE: tl.constexpr,
    SPLITS_PAD: tl.constexpr, E4M3: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (sequence, KV head, split): the split's keys in BLOCK_N tiles of whole blocks
    against the group's query heads, ended as `triton_decode`'s kernel ends a split."""
    # (tiles of whole blocks from a multiple of BLOCK_N)
    seq, kv_head, split, seq_len, first, start, end = program_split(
        seq_lens_ptr, sliding_window, NUM_SPLITS, MIN_SPLIT, BLOCK_N, True, PDL
    )
    heads, offs_d, g_mask, d_mask = group_heads(kv_head, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    wait_for_previous(PDL)
    q_t, q_scale = _query_columns(q_ptr, seq, heads, offs_d, g_mask, d_mask, stride_qt, stride_qh,
                                  E4M3)  # fmt: skip
    # each head's scores to log2 units: the softmax scale, its query's scale and K's
    head_scale = q_scale * (scale * tl.load(kv_scales_ptr) * LOG2E)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_D, GROUP_PAD], dtype=tl.float32)  # O^T, unnormalized
    for start_n in range(start, end, BLOCK_N):
        offs_n = tile_positions(start_n, BLOCK_N, True)
        n_mask = (offs_n >= first) & (offs_n < end)
        k, v_t = e4m3_kv_operands(
            k_cache_ptr, v_cache_ptr, block_table_ptr, start_n, end, kv_head, offs_d, stride_cb,
            stride_cs, stride_ch, stride_vb, stride_vh, BLOCK_SIZE, BLOCK_N, BLOCK_D, E4M3,
        )  # fmt: skip
        s_t = tl.dot(k, q_t) * head_scale[None, :]  # [BLOCK_N, GROUP_PAD], log2 units
        s_t = tl.where(n_mask[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        # NOTE: heads with nothing allowed yet keep m = -inf; subtract 0 there, not -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_t = tl.exp2(s_t - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        if E4M3:
            p_q = (p_t * E4M3_MAX).to(tl.float8e4nv)
            l_i = l_i * alpha + tl.sum(p_q.to(tl.float32), 0) / E4M3_MAX
        else:
            p_q = p_t
            l_i = l_i * alpha + tl.sum(p_t, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p_q)
        m_i = m_new
    v_scale = tl.load(kv_scales_ptr + 1)
    if E4M3:
        v_scale = v_scale / E4M3_MAX
    acc = tl.trans(acc_t) * v_scale  # [GROUP_PAD, BLOCK_D]
    live = live_splits(seq_len, sliding_window, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    finish_split(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, count_ptr, out_ptr, seq, kv_head,
                 split, live, heads, offs_d, g_mask, d_mask, stride_ot, stride_oh, num_heads,
                 NUM_SPLITS, SPLITS_PAD, HEAD_DIM, MERGE)  # fmt: skip


_DECODE_E4M3 = CachedKernel(_decode_e4m3_kernel)
# (BLOCK_N, warps, stages) of a tile at a head of 128 (halved for wider heads)
E4M3_TILE = (128, 4, 3)


def takes_e4m3_products(
    fp8: bool, token_minor: bool, head_dim: int, group: int, softcap: float | None
) -> bool:
    """Whether a decode launch can take `decode_e4m3`: `triton_e4m3.takes_e4m3`, and GQA groups
    of up to 16 query heads (the products' narrow side)."""
    return takes_e4m3(fp8, token_minor, head_dim, softcap) and group <= 16


def decode_e4m3(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # `cache_views`' K and V of an FP8 cache
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    kv_scales: torch.Tensor,  # [2] float32
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # (acc, maxes, sums)
    counters: torch.Tensor,
    num_splits: int,
    min_split: int,
    merge: bool,
) -> None:
    """`triton_decode.decode_attention`'s launch with e4m3 products (`takes_e4m3_products`):
    out, or the splits' partials (merged by the last split to finish when `merge`)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_n, warps, stages = E4M3_TILE
    block_n = kv_tile_tokens(block_n, head_dim)
    acc, maxes, sums = partials
    _DECODE_E4M3[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, acc, maxes, sums,
        counters, out, kv_scales, scale, sliding_window or 0, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(2), metadata.block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), NUM_SPLITS=num_splits,
        MIN_SPLIT=min_split, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=head_dim,
        BLOCK_N=block_n, MERGE=merge, SPLITS_PAD=next_power_of_2(num_splits),
        E4M3=q.is_cuda, **dependent_launch_args(q.device), num_warps=warps, num_stages=stages,
    )  # fmt: skip
