"""Sampling as one race over the vocabulary, in one Triton kernel (the CUDA fast path).

A sampled row's token is argmax over the vocabulary of logit / T + G with G standard Gumbel
noise, -log(-log U): a draw from softmax(logit / T) (the Gumbel-max trick; the torch sampler's
argmax(p / E) race in log space, with no softmax). Greedy rows (T = 0) take argmax(logit). The
noise is Philox, keyed per row at offset (row base + vocabulary index): a seeded request's key
is `position_seed(seed, position)` with base 0, so its draws depend on nothing else (neither
the batch, nor the scheduling, nor the tensor-parallel size); the other rows share the step's
key at bases row * vocab_size.

Each program takes one row and a chunk of the columns, and puts its best (value, index) into
the row's int64 by an atomic max on a packed key: the value's order-preserving bits high, the
complement of the index low, so the larger value wins and ties go to the lower index, as
argmax does. With tensor parallelism each rank races its vocabulary shard (global column
indices) and an all-reduce MAX of the keys decides: no rank gathers the whole vocabulary.
Rows that need the distribution itself (top-k, top-p, min-p, penalties, logprobs) take the
torch sampler instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.engine.layers.grid import cdiv, next_power_of_2

_BLOCK = 4096
_LOW = 0xFFFFFFFF


@triton.jit
def _race_kernel(
    logits_ptr,  # [rows, columns] float32: this rank's vocabulary shard
    stride_row,
    temperature_ptr,  # [rows] float64, 0 for greedy rows
    key_ptr,  # [rows] int64: Philox key
    base_ptr,  # [rows] int64: offset of vocabulary index 0 in the key's stream
    out_ptr,  # [rows] int64 packed keys, filled with the int64 minimum beforehand
    num_columns,
    first_column,  # the global vocabulary index of column 0
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < num_columns
    x = tl.load(logits_ptr + row * stride_row + columns, mask=mask, other=float("-inf"))
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    index = (columns + first_column).to(tl.int64)
    if temperature > 0:
        key = tl.load(key_ptr + row)
        uniform = tl.rand(key, tl.load(base_ptr + row) + index)
        x = x / temperature - tl.log(-tl.log(uniform))
    best = tl.max(x, axis=0)
    where = tl.argmax(x, axis=0, tie_break_left=True)
    bits = best.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats in reverse
    winner = where.to(tl.int64) + first_column + tl.program_id(1) * BLOCK
    tl.atomic_max(out_ptr + row, (ordered.to(tl.int64) << 32) | (4294967295 - winner))


def race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    bases: torch.Tensor,
    first_column: int = 0,
    num_columns: int | None = None,
) -> torch.Tensor:
    """Each row's winner among `logits` [rows, >= num_columns] as packed int64 keys (`winners`
    decodes them; the max over ranks' keys is the winner over their shards)."""
    rows = logits.shape[0]
    num_columns = logits.shape[1] if num_columns is None else num_columns
    out = torch.full((rows,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    assert logits.dtype == torch.float32, "float32 logits"
    assert logits.stride(1) == 1, "contiguous columns"
    block = min(_BLOCK, next_power_of_2(num_columns))
    _race_kernel[(rows, cdiv(num_columns, block))](
        logits,
        logits.stride(0),
        temperature,
        keys,
        bases,
        out,
        num_columns,
        first_column,
        BLOCK=block,
    )
    return out


def winners(packed: torch.Tensor) -> torch.Tensor:
    """Packed keys -> the winning vocabulary indices (int64)."""
    return _LOW - (packed & _LOW)
