"""What both decode kernels (`triton_decode`'s and `triton_decode_e4m3`'s) do at a split's ends:
the range of a sequence's keys it takes and the query heads it serves, then its partial softmax
written out, or, when unsplit or the last split of its KV head to finish, those heads' output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet.engine.attention.triton_tiles import LN2
from kvfleet.engine.layers.dependent_launch import let_next_start


@triton.jit
def _split_size(seq_len, sliding_window, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """(kv_begin, per_split): the first key of the sequence's window and the keys a split takes
    (whole BLOCK_Ns, at least MIN_SPLIT)."""
    kv_begin = 0
    if sliding_window > 0:
        kv_begin = tl.maximum(0, seq_len - sliding_window)
    per_split = tl.cdiv(seq_len - kv_begin, NUM_SPLITS)
    return kv_begin, tl.maximum(tl.cdiv(per_split, BLOCK_N) * BLOCK_N, MIN_SPLIT)


@triton.jit
def split_range(seq_len, sliding_window, split, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """[first, end) of the sequence's keys this split takes: its window cut into NUM_SPLITS
    pieces of whole BLOCK_Ns."""
    kv_begin, per_split = _split_size(seq_len, sliding_window, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    first = kv_begin + split * per_split
    return first, tl.minimum(seq_len, first + per_split)


@triton.jit
def live_splits(seq_len, sliding_window, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """How many of the sequence's splits hold keys (the first ones; at least 1): at a short
    context most of a graph's NUM_SPLITS (cut for its longest) are empty."""
    kv_begin, per_split = _split_size(seq_len, sliding_window, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    return tl.maximum(1, tl.cdiv(seq_len - kv_begin, per_split))


@triton.jit
def program_split(seq_lens_ptr, sliding_window, NUM_SPLITS: tl.constexpr,
                  MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    """(seq, kv_head, split, seq_len, first, start, end) of program (sequence, KV head,
    split), its keys as `split_range` cuts them (tiles from `start`: `first`, or when ALIGNED
    the multiple of BLOCK_N at or below it), after letting the next kernel start (PDL).
    NOTE: before the wait, only what no kernel of the step writes: the sequence's length
    (copied in before the step)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    let_next_start(PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    first, end = split_range(seq_len, sliding_window, split, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    start = first
    if ALIGNED:  # (tiles from a multiple of BLOCK_N; an empty split stays empty)
        start = first // BLOCK_N * BLOCK_N
        end = tl.where(first < end, end, start)
    return seq, kv_head, split, seq_len, first, start, end


@triton.jit
def group_heads(kv_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """(heads, offs_d, g_mask, d_mask): a program's query heads (the GQA group of `kv_head`,
    padded to GROUP_PAD) and its head dimensions (padded to BLOCK_D), with what is real."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    return kv_head * GROUP + offs_g, offs_d, offs_g < GROUP, offs_d < HEAD_DIM


@triton.jit
def finish_split(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, count_ptr, out_ptr, seq, kv_head,
                 split, live, heads, offs_d, g_mask, d_mask, stride_ot, stride_oh, num_heads,
                 NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MERGE: tl.constexpr, LEAVE: tl.constexpr = 0):  # fmt: skip
    """A split's heads: the output when unsplit, else its partial results (max in natural-log
    units, sum, unnormalized P.V), and when MERGE the last split to finish merges them. MERGE
    counts only the `live` splits (`live_splits`): the empty ones store and count nothing, and
    one live split writes the output itself (the same bits: the merge of one split divides
    its sum by its weight, 1).

    LEAVE (one sequence, MERGE): the merge is left to the kernel after (`SplitRows`, the one-row
    GEMV's) where at most LEAVE splits hold keys: split s < LEAVE writes its heads' output
    (P.V over its own sum) into out's row s and their log-sum-exp into max_ptr's (head, s)
    (-inf where it holds no keys); no counter. Past LEAVE live splits the last merges as
    before, into row 0 with log-sum-exp 0 and -inf in the other LEAVE - 1."""
    if NUM_SPLITS == 1:
        _store_output(acc, l_i, out_ptr, seq, heads, offs_d, stride_ot, stride_oh, g_mask, d_mask)
    elif not MERGE:
        # An empty split stores max -inf and sum 0: the merge kernel gives it no weight.
        _store_partial(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, seq, split, heads, offs_d,
                       g_mask, d_mask, num_heads, NUM_SPLITS, HEAD_DIM)  # fmt: skip
    elif LEAVE > 0 and live <= LEAVE:
        if split < LEAVE:
            lse = tl.where(split < live, m_i * LN2 + tl.log(tl.where(l_i > 0.0, l_i, 1.0)),
                           float("-inf"))  # fmt: skip
            tl.store(max_ptr + heads * NUM_SPLITS + split, lse, mask=g_mask)
            if split < live:
                _store_output(acc, l_i, out_ptr, split, heads, offs_d, stride_ot, stride_oh,
                              g_mask, d_mask)  # fmt: skip
    elif live == 1:
        if split == 0:
            _store_output(acc, l_i, out_ptr, seq, heads, offs_d, stride_ot, stride_oh, g_mask,
                          d_mask)  # fmt: skip
    elif split < live:
        _store_partial(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, seq, split, heads, offs_d,
                       g_mask, d_mask, num_heads, NUM_SPLITS, HEAD_DIM)  # fmt: skip
        tl.debug_barrier()  # (every thread's part written before the count says so)
        counter = count_ptr + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == live - 1:
            first_rows = (seq * num_heads + heads) * NUM_SPLITS
            out = merged(acc_ptr, max_ptr, sum_ptr, first_rows, g_mask, offs_d, d_mask, live,
                         NUM_SPLITS, SPLITS_PAD, HEAD_DIM)  # fmt: skip
            store_heads(out, out_ptr, seq, heads, offs_d, stride_ot, stride_oh, g_mask,
                        d_mask)  # fmt: skip
            if LEAVE > 0:  # (the merge has read the maxima: their places take the lse now)
                slots = tl.arange(0, SPLITS_PAD)[None, :]
                tl.store(max_ptr + first_rows[:, None] + slots,
                         tl.where(slots == 0, 0.0, float("-inf")),
                         mask=g_mask[:, None] & (slots < LEAVE))  # fmt: skip
            tl.atomic_xchg(counter, 0)


@triton.jit
def _store_output(acc, l_i, out_ptr, seq, heads, offs_d, stride_ot, stride_oh, g_mask, d_mask):
    """The heads' output from one split's sums: P.V over the softmax's denominator."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    store_heads(out, out_ptr, seq, heads, offs_d, stride_ot, stride_oh, g_mask, d_mask)


@triton.jit
def _store_partial(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, seq, split, heads, offs_d, g_mask,
                   d_mask, num_heads, NUM_SPLITS: tl.constexpr,
                   HEAD_DIM: tl.constexpr):  # fmt: skip
    """A decode split's partial results for its heads (`store_partials`)."""
    rows = (seq * num_heads + heads) * NUM_SPLITS + split
    store_partials(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, rows, g_mask, offs_d, d_mask,
                   HEAD_DIM)  # fmt: skip


@triton.jit
def store_partials(acc, m_i, l_i, acc_ptr, max_ptr, sum_ptr, rows, row_mask, offs_d, d_mask,
                   HEAD_DIM: tl.constexpr):  # fmt: skip
    """A split's partial results for the merge at `rows` of the partials (decode and prompt
    kernels alike): max (natural-log units, from m_i's log2 ones), sum, unnormalized P.V."""
    tl.store(max_ptr + rows, m_i * LN2, mask=row_mask)
    tl.store(sum_ptr + rows, l_i, mask=row_mask)
    tl.store(
        acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        acc,
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def store_heads(out, out_ptr, seq, heads, offs_d, stride_ot, stride_oh, g_mask, d_mask):
    """out [heads, BLOCK_D] (float32) into a sequence's rows of the output, in its dtype."""
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def merged(
    acc_ptr, max_ptr, sum_ptr, first_rows, row_mask, offs_d, d_mask, live,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """[rows, BLOCK_D] float32: each row's first `live` splits (partials at first_rows +
    0..live-1, natural-log maxima) merged as `_decode_merge_kernel` merges one (read past L1:
    other programs wrote them)."""
    offs_s = tl.arange(0, SPLITS_PAD)
    at = first_rows[:, None] + offs_s[None, :]
    ok = row_mask[:, None] & (offs_s < live)[None, :]
    m = tl.load(max_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(sum_ptr + at, mask=ok, other=0.0, cache_modifier=".cg")
    m_all = tl.max(m, 1)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all[:, None]))
    total = tl.sum(weight * l_s, 1)
    out = tl.zeros([first_rows.shape[0], offs_d.shape[0]], dtype=tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        part = tl.load(
            acc_ptr + (first_rows + i)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=tl.where(i < live, row_mask, False)[:, None] & d_mask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        out += part * tl.sum(tl.where(offs_s[None, :] == i, weight, 0.0), 1)[:, None]
    return out / tl.where(total == 0.0, 1.0, total)[:, None]
