"""The packed step message: one step's model inputs as two flat buffers (int64 and int32) plus
a small host header, built by the runner with one copy each and broadcast as-is to the other
tensor-parallel ranks (`TPGroup.broadcast_step`), never pickled requests. `PackedStep.sizes`
and `PackedStep.unpack` are the one place the layout is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.engine.attention.metadata import AttentionMetadata, decodes_to_split

STEP, STOP = 1, 0


# header: op, num_tokens, num_seqs, max_blocks, num_sampled, race
HEADER_LEN = 6


# The host message: the header, then the query and sequence lengths of up to this many
# sequences (a second message carries the rest): one gloo round trip per step, in which rank 0
# waits for every worker to be ready to receive (its cost: bench/RESULTS.md, tensor parallelism).
INLINE_SEQS = 256


@dataclass(frozen=True)
class RaceInputs:
    """Per sampled row, what the vocabulary race needs (`engine/sample/gumbel_race.py`)."""

    keys: torch.Tensor  # [num_sampled] int64
    bases: torch.Tensor  # [num_sampled] int64
    temperature: torch.Tensor  # [num_sampled] float64, 0 in greedy rows


@dataclass(frozen=True)
class StepInputs:
    """What every rank needs for one forward pass (and, for a race, to sample)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64
    race: RaceInputs | None = None  # None: rank 0 samples from the whole vocabulary's logits


# Each part of the packed buffers starts at a multiple of this many bytes, whatever the step's
# sizes: Triton specializes a kernel on whether each pointer is 16-byte aligned, and parts at
# offsets that follow the token count would compile a kernel variant (a fraction of a second,
# bench/RESULTS.md) the first time a step of the other parity comes, mid-serving.
ALIGN_BYTES = 16


def _span(count: int, itemsize: int) -> int:
    """`count` items rounded up to a whole number of alignments."""
    per = ALIGN_BYTES // itemsize
    return -(-count // per) * per


def pack_aligned(parts: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    """`parts` (1-D) one after another in `dtype`, each at an aligned offset (zeros between)."""
    itemsize = np.dtype(dtype).itemsize
    out: np.ndarray = np.zeros(sum(_span(len(part), itemsize) for part in parts), dtype)
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += _span(len(part), itemsize)
    return out


@dataclass(frozen=True)
class PackedStep:
    """One step's inputs in the two flat device buffers the runner fills with one copy each;
    rank 0 broadcasts exactly these. `sizes` and `unpack` are the one place their layout is
    read; each part starts aligned (`pack_aligned`)."""

    # int64: ids, positions, slots [num_tokens each], rows [num_sampled] (then the race's keys,
    # bases and temperatures [num_sampled each], the last as float64 bits)
    longs: torch.Tensor
    ints: torch.Tensor  # int32: tables [num_seqs * max_blocks], cu_q [num_seqs + 1], lens
    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_sampled: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    race: bool = False

    @staticmethod
    def sizes(
        num_tokens: int, num_seqs: int, max_blocks: int, num_sampled: int, race: bool
    ) -> tuple[int, int]:
        """The lengths of `longs` and `ints`."""
        longs = 3 * _span(num_tokens, 8) + _span(num_sampled, 8) * (4 if race else 1)
        ints = _span(num_seqs * max_blocks, 4) + _span(num_seqs + 1, 4) + _span(num_seqs, 4)
        return longs, ints

    def header(self) -> list[int]:
        return [
            STEP,
            self.num_tokens,
            self.num_seqs,
            self.max_blocks,
            self.num_sampled,
            int(self.race),
        ]

    def unpack(self) -> StepInputs:
        n, sampled = _span(self.num_tokens, 8), _span(self.num_sampled, 8)
        ids, positions, slots = self.longs[: 3 * n].view(3, n)[:, : self.num_tokens]
        rows = self.longs[3 * n : 3 * n + self.num_sampled]
        race = None
        if self.race:
            keys, bases, temperature = self.longs[3 * n + sampled : 3 * n + 4 * sampled].view(
                3, sampled
            )[:, : self.num_sampled]
            race = RaceInputs(keys, bases, temperature.view(torch.float64))
        table_size = self.num_seqs * self.max_blocks
        cu_at = _span(table_size, 4)
        lens_at = cu_at + _span(self.num_seqs + 1, 4)
        max_q = max(self.query_lens_cpu)  # (1: a decode step, no rows to count for a split)
        metadata = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.ints[:table_size].view(self.num_seqs, self.max_blocks),
            cu_seqlens_q=self.ints[cu_at : cu_at + self.num_seqs + 1],
            seq_lens=self.ints[lens_at : lens_at + self.num_seqs],
            max_seqlen_q=max_q,
            max_seqlen_k=max(self.seq_lens_cpu),
            query_lens_cpu=self.query_lens_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
            num_decodes=decodes_to_split(self.query_lens_cpu, self.seq_lens_cpu)
            if max_q > 1
            else 0,
        )
        return StepInputs(ids, positions, metadata, rows, race)
