"""Paged decode attention in Triton: GQA-aware and split over the KV length (flash-decoding).

A decode step has one query token per sequence, so the varlen kernel in `triton_attention.py`
would give each program a single query row and read each K/V block once per query head. Here a
program takes all the query heads that share one KV head (a GQA group, padded to 16 rows for
`tl.dot`), so each K/V block is read once per group, and one sequence's KV length is cut into
`num_splits` ranges that run in parallel; a second kernel merges their partial softmaxes. The
ranges are sized in the kernel from each sequence's own length, so a launch captured in a CUDA
graph for the longest context still spreads a short one over every split.

The torch backend (`torch_backend.py`) is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.attention.metadata import AttentionMetadata, cache_views, kv_cache_is_fp8
from kvfleet.engine.attention.triton_decode_e4m3 import decode_e4m3, takes_e4m3_products
from kvfleet.engine.attention.triton_decode_token import (
    earlier_first_tile,
    first_tile_scores,
    new_kv,
    raw_token,
    raw_token_tables,
    write_new_token,
)
from kvfleet.engine.attention.triton_splits import (
    finish_split,
    group_heads,
    live_splits,
    split_range,
)
from kvfleet.engine.attention.triton_tiles import (
    fp8_query,
    kv_tile_tokens,
    load_kv_tile,
    online_softmax,
    score_scale,
    scores,
    tile_positions,
)
from kvfleet.engine.layers.dependent_launch import (
    dependent_launch_args,
    let_next_start,
    wait_for_previous,
)
from kvfleet.engine.layers.grid import next_power_of_2, num_sms
from kvfleet.engine.layers.launch_cache import CachedKernel
from kvfleet.engine.layers.linear import SplitRows
from kvfleet.engine.layers.triton_rope import RawToken

# The fewest KV tokens a split takes: one tile (BLOCK_N), which at batch 1 is loaded before the
# wait (PRELOAD_FIRST_TILE), so a split's work after it is this step's token and the merge. Its
# tiles after the wait cost more than the merge: batch 1 at 129-256 keys, Llama-3-8B 4.192 ms at
# 128 (two splits), 4.230 at 256 (one, no merge), 4.118 at 64 (three or four); Qwen3-30B-A3B
# 2.704 -> 2.638 from 128 to 64 (bench/RESULTS.md "2026-11-30 (session 41)").
_MIN_SPLIT_TOKENS = 64
_MAX_SPLITS = 32
# From this many (sequence, KV head) programs an SM the decode kernel is not split: at 64 x 8
# programs on 132 SMs a second split cost 22.5 us against 17.3 at 64 x U[129, 256] tokens and
# gained nothing at 64 x U[3,000, 5,000] (258.8 against 259.6; bench/RESULTS.md session 29).
_UNSPLIT_PROGRAMS_PER_SM = 3
# (BLOCK_N, warps, stages, register cap) of the partial kernel by cache: bf16/fp16/fp32 (at
# 94-99% of the copy bandwidth), FP8 (twice the tokens per tile keep as many bytes in flight;
# V token-minor loaded a block's run at a time takes 162 registers uncapped, three programs an
# SM, 233.5 us at 256 x U[1,025, 2,047]; capped at 128 it keeps four without spilling, 202.9
# us: bench/RESULTS.md "2026-11-28 (session 26)")
DECODE_TILES: dict[bool, tuple[int, int, int, int | None]] = {
    False: (64, 4, 3, None),
    True: (128, 4, 3, 128),
}


# NOTE: the block table's width changes step to step: one compiled kernel for any width.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_partial_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32: KV length including this step's token
    acc_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32: unnormalized P·V
    max_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32: running max of the scores
    sum_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32: sum of exp(score - max)
    count_ptr,  # [num_seqs * num_kv_heads] int32, zero between launches (MERGE)
    out_ptr,  # [num_seqs, num_heads, head_dim]: written directly when NUM_SPLITS == 1
    kv_scales_ptr,  # [2] float32 (an FP8 cache's)
    new_ptr,  # (RAW_NEW) this step's qkv row, raw (`RawToken`)
    positions_ptr,  # (RAW_NEW) [1] int64
    cos_ptr,  # (RAW_NEW) [max_position, HEAD_DIM / 2] float32
    sin_ptr,
    scale,
    sliding_window,  # 0: none
    softcap,  # read when SOFTCAP
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    num_heads,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 for tl.dot
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,  # (`head_major_blocks`)
    SOFTCAP: tl.constexpr,
    MERGE: tl.constexpr,  # the last split of a sequence's KV head to finish merges its heads
    LEAVE: tl.constexpr,  # (MERGE, one sequence) up to LEAVE live splits left unmerged
    SPLITS_PAD: tl.constexpr,  # (MERGE)
    PRELOAD: tl.constexpr,  # the first tile's earlier tokens loaded before the wait (PDL)
    RAW_NEW: tl.constexpr,  # (one sequence, K-major unquantized cache) this step's token raw:
    # q and k rotated here, k and v written into the cache here
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    let_next_start(PDL)
    # NOTE: before the wait, only what no kernel of the step writes: the sequence's length and
    # block table (copied in before the step) and, PRELOAD, its earlier tokens' K and V (from
    # earlier steps). This step's token, which the kernel before writes (the qkv projection's
    # cache write, or RoPE's), is read after the wait.
    seq_len = tl.load(seq_lens_ptr + seq)
    first, end = split_range(seq_len, sliding_window, split, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    start = first
    if V_TOKEN_MINOR:  # (tiles from multiples of BLOCK_N: a token-minor V loads in vectors)
        start = first // BLOCK_N * BLOCK_N
        end = tl.where(first < end, end, start)  # (an empty split stays empty)

    heads, offs_d, g_mask, d_mask = group_heads(kv_head, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    if PRELOAD:
        k_first, v_first, new_at = earlier_first_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, seq_len, start, end, kv_head, offs_d,
            d_mask, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
        )  # fmt: skip
    if RAW_NEW:  # (the rotation's tables: 0.4-0.6 us a layer less after the wait)
        cos, sin = raw_token_tables(positions_ptr, cos_ptr, sin_ptr, HEAD_DIM,
                                    new_ptr.dtype.element_ty)  # fmt: skip
    wait_for_previous(PDL)
    if RAW_NEW:
        q, k_new, v_new = raw_token(new_ptr, cos, sin, heads, g_mask, kv_head, num_heads, offs_d,
                                    HEAD_DIM)  # fmt: skip
        write_new_token(k_new, v_new, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_len, first,
                        end, kv_head, offs_d, stride_cb, stride_cs, stride_ch,
                        BLOCK_SIZE)  # fmt: skip
    else:
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if PRELOAD:  # (this step's token's K and V with q, their loads in flight together)
            k_new, v_new = new_kv(k_cache_ptr, v_cache_ptr, new_at, d_mask)
    if FP8:
        q = fp8_query(q)
        scale *= tl.load(kv_scales_ptr)
    qk_scale = score_scale(scale, SOFTCAP)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # (log2 units)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    tiles_from = start
    if PRELOAD:
        m_i, l_i, acc = first_tile_scores(
            q, k_first, v_first, k_new, v_new, seq_len, start, end, m_i, l_i, acc, scale,
            softcap, qk_scale, BLOCK_N, DOT_PRECISION, SOFTCAP,
        )  # fmt: skip
        tiles_from = start + BLOCK_N
    for start_n in range(tiles_from, end, BLOCK_N):
        offs_n = tile_positions(start_n, BLOCK_N, V_TOKEN_MINOR)
        n_mask = offs_n < end
        if V_TOKEN_MINOR:  # (the first tile may start before `first`)
            n_mask = n_mask & (offs_n >= first)
        k, v = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            start_n,
            offs_n,
            n_mask,
            end,
            kv_head,
            offs_d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_vb,
            stride_vh,
            BLOCK_SIZE,
            HEAD_DIM,
            FP8,
            V_TOKEN_MINOR,
            q.dtype,
        )
        s = scores(q, k, scale, softcap, DOT_PRECISION, SOFTCAP)  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    if FP8:
        acc *= tl.load(kv_scales_ptr + 1)

    live = live_splits(seq_len, sliding_window, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    finish_split(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, count_ptr, out_ptr, seq, kv_head,
                  split, live, heads, offs_d, g_mask, d_mask, stride_ot, stride_oh, num_heads,
                  NUM_SPLITS, SPLITS_PAD, HEAD_DIM, MERGE, LEAVE)  # fmt: skip


# NOTE: the split count changes step to step (a prefix hit's keys are split by its queries and
# KV): one compiled kernel for any count, or each new count would stall its step for a compile.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    max_ptr,  # [num_seqs, num_heads, num_splits] float32
    sum_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    SPLITS_PAD: tl.constexpr,  # (at least num_splits)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched dependent (engine/layers/dependent_launch.py)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    let_next_start(PDL)
    wait_for_previous(PDL)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(max_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(sum_ptr + row, mask=s_mask, other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    total = tl.sum(weight * l_s, 0)
    acc = tl.load(
        acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def splits_to_fill(
    programs: int, kv_tokens: int, device: torch.device, per_sm: int = 4,
    min_tokens: int = _MIN_SPLIT_TOKENS,
) -> int:  # fmt: skip
    """Splits of the KV that give every SM `per_sm` of `programs` x splits programs, none
    shorter than `min_tokens` of `kv_tokens` (1: the programs are enough already)."""
    wanted = -(-per_sm * num_sms(device) // max(1, programs))
    return max(1, min(wanted, -(-kv_tokens // min_tokens), _MAX_SPLITS))


def num_splits_for(
    num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device
) -> int:
    """The decode kernel's splits: one program per sequence and KV head, times these."""
    programs = num_seqs * num_kv_heads
    if programs >= _UNSPLIT_PROGRAMS_PER_SM * num_sms(device):
        return 1
    return splits_to_fill(programs, max_seqlen_k, device)


# The split counts the decode kernel was launched with (a compiled variant each), by what else
# its variant depends on. A mixed step's decodes, run eagerly beside prompts, split by their
# number and the step's longest KV into counts no decode graph took (22 for three decodes
# beside a 6k prompt where the graphs of 4 and 8 took 17 and 9), each compiled mid-serving
# (~0.2 s); they take the nearest count launched before instead, most often a graph's: the
# largest not above their own, else the smallest.
# (variant -> {split count: whether its first launch preloaded, `PRELOAD_FIRST_TILE`}: a mixed
# step's decodes launch the count as it was launched, a variant compiled before)
_LAUNCHED_SPLITS: dict[tuple[object, ...], dict[int, bool]] = {}


def launched_splits(variant: tuple[object, ...], planned: int) -> int:
    """The split count a mixed step's decodes take: of those launched for `variant`, the
    largest up to `planned`, else the smallest; `planned` when none was."""
    have = _LAUNCHED_SPLITS.get(variant)
    if not have:
        return planned
    return max((count for count in have if count <= planned), default=min(have))


_DECODE_MERGE = CachedKernel(_decode_merge_kernel)
_DECODE_PARTIAL = CachedKernel(_decode_partial_kernel)

# The last split of a sequence's KV head to finish merges its query heads (False: a merge
# kernel after the decode kernel, as before; for A/B runs).
FUSED_MERGE = True
# Where the decode kernel's programs are at most PRELOAD_PROGRAMS_PER_SM an SM (batch 1:
# latency, not bytes), a split's first tile of keys and values from earlier steps is loaded
# before the kernel waits for the one before it (launched dependent, that load overlaps the qkv
# projection's end), this step's token read after; a bf16/fp16/fp32 cache's (an FP8 cache's
# token-minor V loads whole blocks). False: every tile after the wait, as before (for A/B runs).
# Two an SM, not one: batch 1 under an 8k context (8 KV heads x 32 splits) Llama-3-8B 4.213 ->
# 4.166 ms, Qwen3-8B 4.445 -> 4.407 (bench/RESULTS.md "2026-11-30 (session 41)").
PRELOAD_FIRST_TILE = True
PRELOAD_PROGRAMS_PER_SM = 2
# An FP8 cache's decodes through `triton_decode_e4m3` (e4m3 products, no upcasts; the query
# and softmax weights quantized) where it takes them: Llama-3-8B's FP8 1k/1k decode-only steps
# 24.80 -> 23.57 ms (1,982 of them); SmolLM2's FP8-KV perplexity fed a token a step through the
# decode kernels +0.81% over a bf16 cache's, +1.20% upcasting (bench/RESULTS.md "2026-11-30
# (session 39)"). False: the upcasting kernel (for A/B runs).
E4M3_PRODUCTS = True
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # (captured CUDA graphs may still count in them)


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """The device's int32 counters of finished splits, zero between launches (the last split
    resets its own), at least `count` of them: one allocation of 65,536 (1,024 sequences x 64
    KV heads) on first use, normally before any CUDA graph is captured."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < count:
        if have is not None:
            _OUTGROWN.append(have)
        have = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def merge_splits(
    acc: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor, out: torch.Tensor
) -> None:
    """out [rows, heads, D] from the splits' partial results: acc [rows, heads, splits, D]
    (unnormalized P.V), maxes and sums [rows, heads, splits] (natural-log units)."""
    rows, num_heads, num_splits, head_dim = acc.shape
    assert num_splits <= _MAX_SPLITS
    pdl = dependent_launch_args(out.device)
    _DECODE_MERGE[(rows, num_heads)](
        acc,
        maxes,
        sums,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        SPLITS_PAD=next_power_of_2(_MAX_SPLITS),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        **pdl,
    )


def _splits_left(
    leave: int, num_splits: int, num_seqs: int, metadata: AttentionMetadata, e4m3: bool
) -> int:
    """How many splits `decode_attention(leave=...)` leaves unmerged (`SplitRows`): none but in
    a decode-only step of one sequence whose keys are split and merged in the kernel
    (FUSED_MERGE), not the e4m3 one."""
    if not (leave and FUSED_MERGE and num_splits > 1 and num_seqs == 1):
        return 0
    return 0 if metadata.max_seqlen_q > 1 or e4m3 else min(leave, num_splits)


def takes_raw_token(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the decode kernel takes this step's token raw (`RawToken`) over `kv_cache`: a
    K-major (K and V) unquantized cache, heads of a power of two (q in one [group, head_dim]
    tile)."""
    v_cache = cache_views(kv_cache)[1]
    return (
        not kv_cache_is_fp8(kv_cache)
        and v_cache.stride(3) == 1
        and head_dim == next_power_of_2(head_dim)
        and head_dim >= 16
    )


def _preloads(
    launched: dict[int, bool],
    num_splits: int,
    programs: int,
    fp8: bool,
    token_minor: bool,
    mixed: bool,
    device: torch.device,
) -> bool:
    """Whether the decode kernel's splits load their first tile before the wait (PRELOAD);
    recorded in `launched` by split count, which a mixed step's decodes follow (no compile)."""
    # (few programs only: held across the wait, the first tile takes ~45 registers more)
    preload = (
        PRELOAD_FIRST_TILE
        and not fp8
        and not token_minor
        and programs <= PRELOAD_PROGRAMS_PER_SM * num_sms(device)
    )
    if mixed:  # (as the count was launched before: no compile)
        preload = launched.get(num_splits, preload)
    launched.setdefault(num_splits, preload)
    return preload


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [num_seqs, Hq, D], one query token per sequence, against its cached K/V (an FP8
    cache's times `kv_scales`; scores soft-capped at `softcap`): the step's first num_seqs
    sequences, each of one query token."""
    result = decode_leaving_splits(
        q, kv_cache, metadata, scale, sliding_window, out, num_splits, kv_scales, softcap, 0
    )
    assert isinstance(result, torch.Tensor)
    return result


def decode_leaving_splits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
    num_splits: int | None,
    kv_scales: torch.Tensor | None,
    softcap: float | None,
    leave: int,
    new: RawToken | None = None,
) -> torch.Tensor | SplitRows:
    """`decode_attention`, which where `leave` (a decode-only step of one sequence, its keys
    split and merged in the kernel, not the e4m3 one) leaves up to that many splits holding
    keys unmerged: a `SplitRows` for the one-row GEMV after to merge (past that many, the
    kernel merges as before, into the SplitRows' first row). `new` (one sequence's decode, a
    K-major unquantized cache, `takes_raw_token`): q is that row's raw q, rotated here with its
    k, k and v written into the cache here."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if metadata.max_seqlen_q == 1:
        assert metadata.seq_lens.shape[0] == num_seqs
    else:
        assert num_seqs <= metadata.num_decodes, "one query token per sequence"
    if num_seqs == 0:
        return q.new_empty(q.shape) if out is None else out
    group = num_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    k_cache, v_cache = cache_views(kv_cache)
    token_minor = v_cache.stride(3) != 1
    fp8 = kv_cache_is_fp8(kv_cache)
    variant = (q.device, q.dtype, kv_cache.dtype, group, head_dim, block_size, token_minor,
               sliding_window, softcap)  # fmt: skip
    if num_splits is None:
        num_splits = num_splits_for(num_seqs, num_kv_heads, metadata.max_seqlen_k, q.device)
        if metadata.max_seqlen_q > 1:  # (a mixed step's decodes)
            num_splits = launched_splits(variant, num_splits)
    merge = FUSED_MERGE and num_splits > 1
    e4m3 = (
        kv_scales is not None
        and E4M3_PRODUCTS
        and takes_e4m3_products(fp8, token_minor, head_dim, group, softcap)
    )
    left = _splits_left(leave, num_splits, num_seqs, metadata, e4m3)
    assert not left or out is None, "the splits are left in their own rows"
    # (q may be a strided view of the fused QKV output; the result is contiguous)
    if out is None:
        out = q.new_empty((left, num_heads, head_dim) if left else q.shape)
    launched = _LAUNCHED_SPLITS.setdefault(variant, {})
    partial_shape = (num_seqs, num_heads, num_splits)
    acc = q.new_empty((*partial_shape, head_dim), dtype=torch.float32)
    maxes = q.new_empty(partial_shape, dtype=torch.float32)
    sums = q.new_empty(partial_shape, dtype=torch.float32)
    block_n, warps, stages, max_registers = DECODE_TILES[fp8]
    block_n = kv_tile_tokens(block_n, block_d)
    assert not token_minor or block_n % block_size == 0, "token-minor V loads whole blocks"
    assert not token_minor or v_cache.stride(3) == block_size, "a head's token-minor V: one run"
    limits = {} if max_registers is None else {"maxnreg": max_registers}
    pdl = dependent_launch_args(q.device)
    preload = _preloads(launched, num_splits, num_seqs * num_kv_heads * num_splits, fp8,
                        token_minor, metadata.max_seqlen_q > 1, q.device)  # fmt: skip
    counters = split_counters(q.device, num_seqs * num_kv_heads) if merge else metadata.seq_lens
    min_split = _MIN_SPLIT_TOKENS if num_splits > 1 else 1
    assert new is None or (num_seqs == 1 and takes_raw_token(kv_cache, head_dim)), "RawToken"
    raw_args = (new.qkv, new.positions, new.cos, new.sin) if new is not None else (sums,) * 4
    if e4m3:
        assert kv_scales is not None
        decode_e4m3(q, k_cache, v_cache, metadata, scale, sliding_window, kv_scales, out,
                    (acc, maxes, sums), counters, num_splits, min_split, merge)  # fmt: skip
        if num_splits > 1 and not merge:
            merge_splits(acc, maxes, sums, out)
        return out
    _DECODE_PARTIAL[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        acc,
        maxes,
        sums,
        counters,
        out,
        kv_scales if kv_scales is not None else sums,
        *raw_args,
        scale,
        sliding_window or 0,
        softcap or 0.0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(2),
        metadata.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        NUM_SPLITS=num_splits,
        MIN_SPLIT=min_split,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=fp8,
        V_TOKEN_MINOR=token_minor,
        SOFTCAP=softcap is not None,
        MERGE=merge,
        LEAVE=left,
        SPLITS_PAD=next_power_of_2(num_splits),
        PRELOAD=preload,
        RAW_NEW=new is not None,
        **pdl,
        num_warps=warps,
        num_stages=stages,
        **limits,
    )
    if left:
        return SplitRows(out.view(left, num_heads * head_dim), maxes[0])
    if num_splits > 1 and not merge:
        merge_splits(acc, maxes, sums, out)
    return out
