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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kvfleet.engine.parallel.partition import TPPlan
from kvfleet.engine.parallel.peer import PeerAllReduce
from kvfleet.engine.parallel.step_message import (
    HEADER_LEN,
    INLINE_SEQS,
    STOP,
    PackedStep,
    StepInputs,
)

if TYPE_CHECKING:
    from kvfleet.engine.layers.torch_layers import RMSNorm

# A collective with a dead peer fails (gloo) or is abandoned (NCCL) after this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


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
        inline = 2 * INLINE_SEQS
        message = step.header() + lens[:inline]
        self._broadcast_host(torch.tensor(message + [0] * (HEADER_LEN + inline - len(message))))
        if len(lens) > inline:
            self._broadcast_host(torch.tensor(lens[inline:]))
        self._broadcast(step.longs)
        self._broadcast(step.ints)

    def broadcast_stop(self) -> None:
        self._broadcast_host(torch.zeros(HEADER_LEN + 2 * INLINE_SEQS, dtype=torch.int64))

    def receive_step(self) -> StepInputs | None:
        """Ranks > 0: the next step's inputs, or None when rank 0 stops. Waits on the host for
        rank 0; never on this rank's device."""
        message = torch.empty(HEADER_LEN + 2 * INLINE_SEQS, dtype=torch.int64)
        self._broadcast_host(message)
        op, n, num_seqs, max_blocks, num_sampled, race = message[:HEADER_LEN].tolist()
        if op == STOP:
            return None
        lens = message[HEADER_LEN : HEADER_LEN + 2 * num_seqs]
        if 2 * num_seqs > 2 * INLINE_SEQS:
            rest = torch.empty(2 * (num_seqs - INLINE_SEQS), dtype=torch.int64)
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
