"""The varlen paged attention kernel of prompt chunks (and of decode rows a step does not send to
the decode kernel): each program takes BLOCK_M query tokens of one sequence and one query head,
and walks that sequence's KV blocks through its block table with an online softmax; where a
step has too few query blocks to fill the GPU over a long KV (a prefix-cache hit's few new
tokens after thousands cached), the keys are split across programs and merged as the decode
kernel's splits are. The torch backend (`torch_backend.py`) is its reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from kvfleet.engine.attention.metadata import AttentionMetadata, cache_views, kv_cache_is_fp8
from kvfleet.engine.attention.triton_decode import merge_splits, splits_to_fill
from kvfleet.engine.attention.triton_e4m3 import (
    E4M3_MAX,
    e4m3_kv_operands,
    e4m3_rows,
    online_softmax_e4m3,
    takes_e4m3,
)
from kvfleet.engine.attention.triton_splits import store_partials
from kvfleet.engine.attention.triton_tiles import (
    fp8_query,
    kv_tile_tokens,
    load_kv_tile,
    online_softmax,
    score_scale,
    scores,
    tile_positions,
)
from kvfleet.engine.layers.grid import cdiv, next_power_of_2, num_sms
from kvfleet.engine.layers.launch_cache import CachedKernel

# (BLOCK_M, BLOCK_N, warps, stages) of the prompt kernel by (FP8 cache, kind of step): "short"
# (no query longer than SHORT_QUERY_TOKENS: decode rows, drafts), "long" (LONG_KV_TOKENS of KV or
# more), "few" (no query longer than FEW_QUERY_TOKENS: a prefix hit's new tokens), "chunks"
# (longer queries: the 1,024-token prompts of the offline runs). Measured
# (bench/attention_steps.py --part prompt; bench/RESULTS.md "2026-11-27 (session 19)" and
# "2026-11-28 (session 26)"): over a bf16 cache 128 x 128 tiles (8 warps) are fastest from a
# 2k chunk after 6k cached to an 8k prompt, 64 x 32 on ~1k prompts (by 10%: 128-row programs
# are too few to fill the GPU) and on 32 new tokens after 3k cached; over an FP8 cache 128 x
# 128 in two stages for ~1k prompts and up (the upcast tiles take the third's room), 64 x 64
# on 32 new tokens after 3k cached (30 us a layer against 128 x 128's 44).
PROMPT_TILES: dict[tuple[bool, str], tuple[int, int, int, int]] = {
    (False, "short"): (16, 64, 4, 3),
    (True, "short"): (16, 64, 4, 3),
    (False, "few"): (64, 32, 4, 3),
    (True, "few"): (64, 64, 4, 3),
    (False, "chunks"): (64, 32, 4, 3),
    (True, "chunks"): (128, 128, 8, 2),
    (False, "long"): (128, 128, 8, 3),
    (True, "long"): (128, 128, 8, 2),
}
SHORT_QUERY_TOKENS = 16
LONG_KV_TOKENS = 4096
FEW_QUERY_TOKENS = 64
# An FP8 cache's prompt steps with the products of e4m3 values as the cache holds them, the
# queries and softmax weights quantized (`triton_e4m3`), where the tile's query rows are at
# least the products' 64 (not "short" steps). Off: SmolLM2's FP8-KV perplexity rises 1.55% over
# a bf16 cache's with it, 0.97% upcasting (the bar: 1%), for prompt steps 2% shorter (Llama-3-8B
# FP8 1k/1k: 133.42 -> 130.86 ms; bench/RESULTS.md "2026-11-30 (session 39)"); on for A/B runs.
E4M3_PRODUCTS = False


def prompt_step_kind(metadata: AttentionMetadata) -> str:
    """The PROMPT_TILES kind of a step (above)."""
    if metadata.max_seqlen_q <= SHORT_QUERY_TOKENS:
        return "short"
    if metadata.max_seqlen_k >= LONG_KV_TOKENS:
        return "long"
    return "few" if metadata.max_seqlen_q <= FEW_QUERY_TOKENS else "chunks"


def prompt_tile(
    dtype: torch.dtype, fp8: bool, kind: str, block_d: int = 128
) -> tuple[int, int, int, int]:
    """PROMPT_TILES' tile for queries of `dtype` and heads padded to `block_d` (float32 ones
    take "chunks" tiles for "long" steps: 128 x 128 float32 tiles would need 320 KB of shared
    memory; heads past 128 fewer tokens a tile: `triton_tiles.kv_tile_tokens`)."""
    if kind == "long" and dtype == torch.float32:
        kind = "chunks"
    block_m, block_n, warps, stages = PROMPT_TILES[fp8, kind]
    return block_m, kv_tile_tokens(block_n, block_d), warps, stages


# The fewest keys a split of the prompt kernel's takes (the decode kernel's take fewer:
# `triton_decode._MIN_SPLIT_TOKENS`, one tile, where a split's work after its wait is what counts).
MIN_SPLIT_TOKENS = 128
# Split counts forced by `splits_forced` (innermost last).
_forced_splits: list[int] = []


@contextmanager
def splits_forced(num_splits: int) -> Iterator[None]:
    """Every prompt-kernel launch inside splits its keys `num_splits` ways (the warm-up:
    a split launch and an unsplit one are two compiled variants of each tile)."""
    _forced_splits.append(num_splits)
    try:
        yield
    finally:
        _forced_splits.pop()


@triton.jit
def _key_range(first_pos, seq_len, sliding_window, split, num_splits, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The keys of a query block whose first row sits at `first_pos`: (begin, end of the
    tiles every row sees whole, so unmasked; end). Tiles from the unmasked end up to the
    diagonal are masked (with a window, every tile). With SPLIT, this split's share."""
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    kv_begin = 0
    unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    if sliding_window > 0:
        kv_begin = (tl.maximum(0, first_pos - sliding_window + 1) // BLOCK_N) * BLOCK_N
        unmasked_end = kv_begin
    if SPLIT:  # (in whole tiles)
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
        kv_begin += split * per_split
        kv_end = tl.minimum(kv_end, kv_begin + per_split)
        unmasked_end = tl.minimum(unmasked_end, (kv_end // BLOCK_N) * BLOCK_N)
    return kv_begin, unmasked_end, kv_end


@triton.jit
def _tile(q, q_scale, k_cache_ptr, v_cache_ptr, table, start_n, offs_n, n_mask, kv_end, kv_head,
          offs_d, d_mask, scale, softcap, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh,
          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
          V_TOKEN_MINOR: tl.constexpr, SOFTCAP: tl.constexpr, E4M3_OPERANDS: tl.constexpr,
          E4M3: tl.constexpr):  # fmt: skip
    """A KV tile's scores [BLOCK_M, BLOCK_N] (unmasked) and its values: V [BLOCK_N, BLOCK_D]
    upcast where FP8 (`load_kv_tile`), or V^T [BLOCK_D, BLOCK_N] as the cache holds it with
    E4M3_OPERANDS (`e4m3_kv_operands`: whole blocks; the caller masks past kv_end)."""
    if E4M3_OPERANDS:
        k, v = e4m3_kv_operands(
            k_cache_ptr, v_cache_ptr, table, start_n, kv_end, kv_head, offs_d, stride_cb,
            stride_cs, stride_ch, stride_vb, stride_vh, BLOCK_SIZE, BLOCK_N, BLOCK_D, E4M3,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k)) * q_scale[:, None]
    else:
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table, start_n, offs_n, n_mask, kv_end, kv_head, offs_d,
            d_mask, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, BLOCK_SIZE, HEAD_DIM,
            FP8, V_TOKEN_MINOR, q.dtype,
        )  # fmt: skip
        s = scores(q, k, scale, softcap, DOT_PRECISION, SOFTCAP)
    return s, v


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                  E4M3_OPERANDS: tl.constexpr, E4M3: tl.constexpr):  # fmt: skip
    """The tile into the running softmax: `online_softmax`, or with E4M3_OPERANDS its e4m3
    form over V^T."""
    if E4M3_OPERANDS:
        m_i, l_i, acc = online_softmax_e4m3(s, v, m_i, l_i, acc, qk_scale, E4M3)
    else:
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    return m_i, l_i, acc


# NOTE: the block table's width and the first sequence change step to step: one compiled
# kernel for any.
@triton.jit(do_not_specialize=["stride_bt", "first_seq", "num_splits"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]: written directly when NUM_SPLITS == 1
    acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32: unnormalized P.V
    max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32: running max (natural log units)
    sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32: sum of exp(score - max)
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32: KV length after this step
    kv_scales_ptr,  # [2] float32 (an FP8 cache's K and V scales)
    scale,
    sliding_window,  # 0: none
    softcap,  # read when SOFTCAP
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,  # V's (read when V_TOKEN_MINOR)
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    first_seq,  # the sequences before it are another kernel's (decode rows)
    num_splits,  # programs sharing a query block's keys (merged after; 1 without SPLIT)
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32 rounding), else "tf32"
    FP8: tl.constexpr,  # the cache holds e4m3 K / k_scale and V / v_scale
    V_TOKEN_MINOR: tl.constexpr,  # (`head_major_blocks`)
    SOFTCAP: tl.constexpr,  # scores soft-capped: softcap * tanh(s / softcap)
    SPLIT: tl.constexpr,  # num_splits > 1: partial results out, for the merge
    E4M3_OPERANDS: tl.constexpr,  # an FP8 cache's K and V multiplied as they lie (`triton_e4m3`)
    E4M3: tl.constexpr,  # (E4M3_OPERANDS) in e4m3, the queries and weights quantized; else f32
):
    # (the last query blocks, which attend to the most keys, start first)
    split = tl.program_id(0) % num_splits
    m_block = tl.num_programs(0) // num_splits - 1 - tl.program_id(0) // num_splits
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // QUERIES_PER_KV

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Absolute positions of this program's queries; padding rows sit past the last one.
    q_pos = seq_len - q_len + offs_m

    q_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if E4M3_OPERANDS:
        q, q_scale = e4m3_rows(q.to(tl.float32), E4M3)
        scale *= tl.load(kv_scales_ptr)
    elif FP8:
        q = fp8_query(q)
        scale *= tl.load(kv_scales_ptr)
    m_i, l_i, acc = (  # (the running max, sum and P.V)
        tl.full([BLOCK_M], float("-inf"), dtype=tl.float32),
        tl.zeros([BLOCK_M], dtype=tl.float32),
        tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
    )

    kv_begin, unmasked_end, kv_end = _key_range(
        seq_len - q_len + m_block * BLOCK_M, seq_len, sliding_window, split, num_splits,
        BLOCK_M, BLOCK_N, SPLIT,
    )  # fmt: skip
    table = block_tables_ptr + seq * stride_bt
    qk_scale = score_scale(scale, SOFTCAP)
    # (every tile starts at a multiple of BLOCK_N, which a token-minor V's vectors rely on)
    for start_n in range(kv_begin, unmasked_end, BLOCK_N):
        offs_n = tile_positions(start_n, BLOCK_N, V_TOKEN_MINOR)
        s, v = _tile(q, q_scale, k_cache_ptr, v_cache_ptr, table, start_n, offs_n,
                     offs_n < unmasked_end, unmasked_end, kv_head, offs_d, d_mask, scale, softcap,
                     stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, BLOCK_SIZE, HEAD_DIM,
                     BLOCK_N, BLOCK_D, DOT_PRECISION, FP8, V_TOKEN_MINOR, SOFTCAP, E4M3_OPERANDS,
                     E4M3)  # fmt: skip
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                      E4M3_OPERANDS, E4M3)  # fmt: skip
    for start_n in range(tl.maximum(kv_begin, unmasked_end), kv_end, BLOCK_N):
        offs_n = tile_positions(start_n, BLOCK_N, V_TOKEN_MINOR)
        n_mask = offs_n < kv_end
        s, v = _tile(q, q_scale, k_cache_ptr, v_cache_ptr, table, start_n, offs_n, n_mask, kv_end,
                     kv_head, offs_d, d_mask, scale, softcap, stride_cb, stride_cs, stride_ch,
                     stride_vb, stride_vh, BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION,
                     FP8, V_TOKEN_MINOR, SOFTCAP, E4M3_OPERANDS, E4M3)  # fmt: skip
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if sliding_window > 0:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, qk_scale, DOT_PRECISION,
                                      E4M3_OPERANDS, E4M3)  # fmt: skip

    if FP8:
        acc *= tl.load(kv_scales_ptr + 1)
    if E4M3:
        acc /= E4M3_MAX
    tokens = q_start + offs_m
    if not SPLIT:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )
    else:  # (an empty split stores max -inf and sum 0: the merge gives it no weight)
        rows = (tokens * tl.num_programs(2) + head) * num_splits + split
        store_partials(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, rows, m_mask, offs_d, d_mask,
                       HEAD_DIM)  # fmt: skip


_PAGED_ATTENTION = CachedKernel(_paged_attention_kernel)


def key_splits(metadata: AttentionMetadata, programs: int, device: torch.device) -> int:
    """How many ways a step's `programs` (query blocks x sequences x heads) split their keys.
    Few queries a sequence (a prefix hit's new tokens) over many keys: until every SM has four
    programs. Longer queries: only where the programs would leave half the SMs idle, and then
    until each has one; their programs are many otherwise, and the merge after costs more than
    the split wins (a lone 1,024-token prompt on an H200: 51 us a layer whole, 90 in two splits
    merged; bench/RESULTS.md "2026-11-29 (session 33)")."""
    if metadata.max_seqlen_q <= FEW_QUERY_TOKENS:
        return splits_to_fill(programs, metadata.max_seqlen_k, device, 4, MIN_SPLIT_TOKENS)
    if 2 * programs >= num_sms(device):
        return 1
    return splits_to_fill(programs, metadata.max_seqlen_k, device, 1, MIN_SPLIT_TOKENS)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    first_seq: int = 0,
) -> torch.Tensor:
    """q [num_tokens, Hq, D] against each sequence's cached K/V -> [num_tokens, Hq, D] (an
    FP8 cache's times `kv_scales`; scores soft-capped at `softcap`); from sequence
    `first_seq` on (the rows of the ones before it are left as they are in `out`)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    out = q.new_empty(q.shape) if out is None else out  # (contiguous, whatever q's strides)
    num_seqs = metadata.seq_lens.shape[0] - first_seq
    if num_seqs == 0:
        return out
    fp8 = kv_cache_is_fp8(kv_cache)
    block_d = max(16, next_power_of_2(head_dim))
    block_m, block_n, warps, stages = prompt_tile(q.dtype, fp8, prompt_step_kind(metadata), block_d)
    m_blocks = cdiv(metadata.max_seqlen_q, block_m)
    num_splits = (
        _forced_splits[-1]
        if _forced_splits
        else key_splits(metadata, m_blocks * num_seqs * num_heads, q.device)
    )
    # Partial results of split keys (whole: never touched, any tensor stands in for them)
    acc = maxes = sums = metadata.seq_lens
    if num_splits > 1:
        partial = (q.shape[0], num_heads, num_splits)
        acc = q.new_empty((*partial, head_dim), dtype=torch.float32)
        maxes = q.new_empty(partial, dtype=torch.float32)
        sums = torch.empty_like(maxes)
    k_cache, v_cache = cache_views(kv_cache)
    token_minor = v_cache.stride(3) != 1
    assert not token_minor or block_n % kv_cache.shape[2] == 0, "token-minor V: whole blocks"
    assert not token_minor or v_cache.stride(3) == kv_cache.shape[2], "a head's V: one run"
    e4m3 = (
        E4M3_PRODUCTS
        and block_m >= 64
        and kv_scales is not None
        and takes_e4m3(fp8, token_minor, head_dim, softcap)
    )
    _PAGED_ATTENTION[(m_blocks * num_splits, num_seqs, num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        acc,
        maxes,
        sums,
        metadata.block_tables,
        metadata.cu_seqlens_q,
        metadata.seq_lens,
        kv_scales if kv_scales is not None else metadata.seq_lens,
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
        out.stride(0),
        out.stride(1),
        metadata.block_tables.stride(0),
        first_seq,
        num_splits,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=fp8,
        V_TOKEN_MINOR=token_minor,
        SOFTCAP=softcap is not None,
        SPLIT=num_splits > 1,
        E4M3_OPERANDS=e4m3,
        E4M3=e4m3 and q.is_cuda,
        num_warps=warps,
        num_stages=stages,
    )
    if num_splits > 1:  # (the decode rows before first_seq hold a token each)
        merge_splits(acc[first_seq:], maxes[first_seq:], sums[first_seq:], out[first_seq:])
    return out
