"""TPGroup: the collectives tensor-parallel ranks run, and the per-step broadcast of inputs.

Rank 0 (the engine process) schedules and samples. Each step it broadcasts the flattened model
inputs, never pickled requests: a small header and the sequence lengths go to the host of every
rank (over gloo, so no rank ever waits on its device to read them), then the two device buffers
the runner already builds (one int64, one int32) over the device group. The other ranks rebuild
the attention metadata from them and queue the forward, its collectives included, while their
device still runs the step before.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.parallel.partition import TPPlan
from kvfleet.engine.parallel.peer import PeerAllReduce

if TYPE_CHECKING:
    from kvfleet.engine.models.layers import RMSNorm

STEP, STOP = 1, 0
# header: op, num_tokens, num_seqs, max_blocks, num_sampled, race
_HEADER = 6
# The host message: the header, then the query and sequence lengths of up to this many
# sequences (a second message carries the rest): one gloo round trip per step, in which rank 0
# waits for every worker to be ready to receive (seen on 2 x H200 at 0.2-0.5 ms).
_INLINE_SEQS = 256
# A collective with a dead peer fails (gloo) or is abandoned (NCCL) after this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class RaceInputs:
    """Per sampled row, what the vocabulary race needs (`engine/triton_sampler.py`)."""

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
# offsets that follow the token count would compile a kernel variant (0.2-0.6 s on an H100)
# the first time a step of the other parity comes, mid-serving.
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
        metadata = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.ints[:table_size].view(self.num_seqs, self.max_blocks),
            cu_seqlens_q=self.ints[cu_at : cu_at + self.num_seqs + 1],
            seq_lens=self.ints[lens_at : lens_at + self.num_seqs],
            max_seqlen_q=max(self.query_lens_cpu),
            max_seqlen_k=max(self.seq_lens_cpu),
            query_lens_cpu=self.query_lens_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
        )
        return StepInputs(ids, positions, metadata, rows, race)


class TPGroup:
    def __init__(
        self, plan: TPPlan, device: torch.device, group: Any = None, host_group: Any = None
    ) -> None:
        self.plan = plan
        self.rank = plan.rank
        self.world_size = plan.world_size
        self.device = device
        self.group = group  # the device's collectives (NCCL on CUDA)
        self.host_group = host_group if host_group is not None else group  # gloo, host tensors
        self.peer: PeerAllReduce | None = None  # latency-bound all-reduces, where available

    @classmethod
    def initialize(cls, plan: TPPlan, device: torch.device, port: int) -> TPGroup:
        """Join the group (rank 0 listens on 127.0.0.1:`port`): NCCL on CUDA, gloo on the CPU."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        host_group = dist.new_group(backend="gloo") if backend == "nccl" else None
        return cls(plan, device, dist.group.WORLD, host_group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.peer is not None and self.peer.fits(tensor):
            return self.peer(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm` of (the ranks' partial sums summed) + residual: one kernel through peer
        memory where it fits, else the all-reduce and then the norm."""
        if self.peer is not None and norm.fused and self.peer.fits_norm(partial, residual):
            return self.peer.add_rms_norm(partial, residual, norm.weight, norm.eps)
        normed: tuple[torch.Tensor, torch.Tensor] = norm(self.all_reduce(partial), residual)
        return normed

    def enable_peer_all_reduce(
        self, capacity: int, dtype: torch.dtype, hidden: int | None = None, prefill_rows: int = 0
    ) -> bool:
        """All-reduces of up to `capacity` elements of `dtype` through peer memory, if every
        rank can (collective: all ranks call it at the same point); fused with the RMSNorm after
        them for rows of `hidden` elements, up to capacity // hidden rows one-shot and up to
        `prefill_rows` two-shot. Whether it is on."""
        if self.min_int(int(PeerAllReduce.possible(self.device))) == 0:
            return False  # (decided together: the rendezvous needs every rank)
        peer = PeerAllReduce.create(
            self.group.group_name, capacity, dtype, self.device, hidden, prefill_rows
        )
        if self.min_int(int(peer is not None)) == 1:
            self.peer = peer
        return self.peer is not None

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab_per_rank] on every rank -> [rows, vocab_size] (padding dropped)."""
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over ranks, in place."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (KV-cache blocks all ranks can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def broadcast_step(self, step: PackedStep) -> None:
        """Rank 0: send one step's inputs to the other ranks (its own buffers, no copies)."""
        lens = step.query_lens_cpu + step.seq_lens_cpu
        inline = 2 * _INLINE_SEQS
        message = step.header() + lens[:inline]
        self._broadcast_host(torch.tensor(message + [0] * (_HEADER + inline - len(message))))
        if len(lens) > inline:
            self._broadcast_host(torch.tensor(lens[inline:]))
        self._broadcast(step.longs)
        self._broadcast(step.ints)

    def broadcast_stop(self) -> None:
        self._broadcast_host(torch.zeros(_HEADER + 2 * _INLINE_SEQS, dtype=torch.int64))

    def receive_step(self) -> StepInputs | None:
        """Ranks > 0: the next step's inputs, or None when rank 0 stops. Waits on the host for
        rank 0; never on this rank's device."""
        message = torch.empty(_HEADER + 2 * _INLINE_SEQS, dtype=torch.int64)
        self._broadcast_host(message)
        op, n, num_seqs, max_blocks, num_sampled, race = message[:_HEADER].tolist()
        if op == STOP:
            return None
        lens = message[_HEADER : _HEADER + 2 * num_seqs]
        if 2 * num_seqs > 2 * _INLINE_SEQS:
            rest = torch.empty(2 * (num_seqs - _INLINE_SEQS), dtype=torch.int64)
            self._broadcast_host(rest)
            lens = torch.cat((lens, rest))
        num_longs, num_ints = PackedStep.sizes(n, num_seqs, max_blocks, num_sampled, bool(race))
        longs = torch.empty(num_longs, dtype=torch.int64, device=self.device)
        ints = torch.empty(num_ints, dtype=torch.int32, device=self.device)
        self._broadcast(longs)
        self._broadcast(ints)
        query_lens, seq_lens = lens[:num_seqs].tolist(), lens[num_seqs:].tolist()
        return PackedStep(
            longs, ints, n, num_seqs, max_blocks, num_sampled, query_lens, seq_lens, bool(race)
        ).unpack()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.group)

    def _broadcast_host(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.host_group)

    def close(self) -> None:
        """Leave the group, every rank together (rank 0 after `broadcast_stop`, the others on
        receiving it): NCCL's finalize waits for all ranks. The caller frees CUDA graphs that
        hold this group's kernels first."""
        if dist.is_initialized():
            dist.destroy_process_group()
