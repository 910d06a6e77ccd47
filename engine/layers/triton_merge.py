"""One row decode attention left as unmerged splits (`linear.SplitRows`), merged head by head
as a one-row GEMV reads it (`triton_gemv`'s bf16/fp16 kernel, `triton_packed`'s 4/8-bit one),
with the weights `triton_splits.merged` would give the splits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merged_values(parts_ptr, lse_ptr, lse_stride, k0, K, SPLITS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                   EAGER: tl.constexpr = False):  # fmt: skip
    """float32 [BLOCK_K]: the row's inputs k0 + [0, BLOCK_K) (0 past K; BLOCK_K a multiple of
    HEAD_DIM, k0 too) from decode attention's unmerged splits (`SplitRows`): each split's rows
    weighted by exp(lse_s - max_s lse_s) of its head over the weights' sum
    (`triton_splits.merged`'s weights), the weights made once a head, not once an input. One
    split holding keys gives its row as it is (weight 1, the others 0); a split holding none is
    not read (EAGER: read with the others, its stale row not used: no load waits on an lse)."""
    HEADS: tl.constexpr = BLOCK_K // HEAD_DIM
    heads = k0 // HEAD_DIM + tl.arange(0, HEADS)
    head_ok = heads * HEAD_DIM < K
    lse_at = lse_ptr + heads * lse_stride
    top = tl.full([HEADS], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(lse_at + s, mask=head_ok, other=float("-inf")))
    ks = heads[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    total = tl.zeros([HEADS], tl.float32)
    x = tl.zeros([HEADS, HEAD_DIM], tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_at + s, mask=head_ok, other=float("-inf"))
        weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
        total += weight
        if EAGER:
            part = tl.load(parts_ptr + s * K + ks, mask=head_ok[:, None], other=0.0)
            x += tl.where(weight[:, None] > 0.0, weight[:, None] * part.to(tl.float32), 0.0)
        else:
            part = tl.load(parts_ptr + s * K + ks, mask=(weight > 0.0)[:, None], other=0.0)
            x += weight[:, None] * part.to(tl.float32)
    x = x * (1.0 / tl.where(total == 0.0, 1.0, total))[:, None]
    return tl.reshape(x, [BLOCK_K])
