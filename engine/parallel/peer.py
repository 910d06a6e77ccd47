"""PeerAllReduce: all-reduce by reading the other GPUs' memory directly (one-shot), for steps
whose all-reduces are latency-bound.

Each rank copies its partial sums into a buffer every rank can address (PyTorch's symmetric
memory over NVLink), waits for the others at a device-side barrier, and adds all ranks'
buffers in rank order, so every rank gets the same bits. One kernel, no NCCL protocol: on
2 x H200 a 16 KiB all-reduce (one Llama-3-70B decode token) takes 6.3 us in a CUDA graph
against NCCL's 23.4 us, and 2 MiB (256 Llama-3-8B tokens) 18.7 against 46.0
(bench/allreduce.py). The kernel ends with a second barrier, so the next all-reduce may
overwrite the buffer at once. From 2 MiB on, two-shot: each rank sums its share of the
elements from every buffer, then the shares are gathered (less traffic per GPU, one more step).

The all-reduce before an RMSNorm runs fused with it (residual add and norm in the same
kernel, `triton_peer.py`), in the lanes' own parts of the same allocation: one-shot lanes for
decode batches (up to capacity // hidden rows), a two-shot lane for larger steps (prefill, up to
`prefill_rows` rows).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, cast

import torch

logger = logging.getLogger(__name__)

# From this size on, the two-shot algorithm: where it overtakes one-shot on 2 x H200
# (bench/allreduce.py; bench/RESULTS.md).
TWO_SHOT_MIN_BYTES = 2 << 20
_MAX_RANKS = 8  # (room for the fused kernel's flags)


class PeerAllReduce:
    # NOTE: symmetric-memory rendezvous keys count allocations per process: a second group in
    # the same process (a second tensor-parallel engine) would wait for keys its fresh workers
    # never write. Only the first group of a process uses peer memory; later ones keep NCCL.
    tried_in_this_process: ClassVar[bool] = False

    def __init__(
        self,
        group_name: str,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        hidden: int | None = None,
        lanes: tuple[int, ...] | None = None,
        prefill_rows: int = 0,
    ):
        """Collective: every rank of the group builds its own at the same point. `capacity`:
        elements of the largest all-reduce; `hidden`: the row size of fused all-reduce +
        RMSNorm calls (None: no fused calls), of up to capacity // hidden rows in the one-shot
        lanes, and up to `prefill_rows` in the two-shot one; `lanes`: the one-shot kernel's
        program counts (default `triton_peer.LANES`)."""
        import torch.distributed._symmetric_memory as symm_mem

        from kvfleet.engine.parallel import triton_peer

        self.group_name = group_name
        self.dtype = dtype
        self.capacity = capacity
        self.hidden = hidden or 0
        # [capacity | each lane's two halves | the two-shot lane's four halves | int32 flags:
        # [lane programs, _MAX_RANKS] per lane, then [2, two-shot programs, _MAX_RANKS]]
        shapes = _lane_shapes(lanes, capacity // hidden if hidden else 0)
        two_shot_rows = prefill_rows if shapes and prefill_rows > shapes[-1][1] else 0
        two_shot_half = two_shot_rows * self.hidden
        one_shot_end = capacity + sum(2 * rows * self.hidden for _, rows in shapes)
        halves_end = one_shot_end + 4 * two_shot_half
        flags_start = halves_end + halves_end % 2  # (4-byte aligned for any 2- or 4-byte dtype)
        element = torch.empty((), dtype=dtype).element_size()
        two_shot_programs = triton_peer.TWO_SHOT_PROGRAMS if two_shot_rows else 0
        programs = sum(count for count, _ in shapes)
        flag_elements = (programs + 2 * two_shot_programs) * _MAX_RANKS * 4 // element
        self.buffer = symm_mem.empty(flags_start + flag_elements, dtype=dtype, device=device)
        self.buffer[flags_start:].zero_()
        torch.cuda.synchronize(device)  # (zero before the rendezvous lets any peer signal)
        handle = symm_mem.rendezvous(self.buffer, group=cast(Any, group_name))
        self.rank: int = handle.rank
        self.world_size: int = handle.world_size
        self._bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        counters = torch.zeros(programs + two_shot_programs, dtype=torch.int32, device=device)
        self.lanes: list[triton_peer.Lane] = []
        self.two_shot: triton_peer.TwoShotLane | None = None
        if self.world_size > _MAX_RANKS:
            shapes, two_shot_rows = [], 0  # (no room for its flags: unfused)
        if two_shot_rows:
            self.two_shot = triton_peer.TwoShotLane(
                two_shot_programs,
                two_shot_rows,
                one_shot_end,
                one_shot_end + 2 * two_shot_half,
                two_shot_half,
                flags_start * element // 4 + programs * _MAX_RANKS,
                counters[programs:],
            )
        offset, first_program = capacity, 0
        for count, rows in shapes:
            self.lanes.append(
                triton_peer.Lane(
                    count,
                    rows,
                    offset,
                    rows * self.hidden,
                    flags_start * element // 4 + first_program * _MAX_RANKS,
                    counters[first_program : first_program + count],
                )
            )
            offset += 2 * rows * self.hidden
            first_program += count
        self._one_shot: Any = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        self._two_shot: Any = torch.ops.symm_mem.two_shot_all_reduce_out

    @classmethod
    def possible(cls, device: torch.device) -> bool:
        """Whether this process can still set one up (asked of every rank before trying)."""
        return device.type == "cuda" and not cls.tried_in_this_process

    @classmethod
    def create(
        cls,
        group_name: str,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        hidden: int | None = None,
        prefill_rows: int = 0,
    ) -> PeerAllReduce | None:
        """One, or None where peer memory is not available (then NCCL all-reduces)."""
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return None
        PeerAllReduce.tried_in_this_process = True
        try:
            return cls(group_name, capacity, dtype, device, hidden, prefill_rows=prefill_rows)
        except (ImportError, AttributeError, RuntimeError) as exc:
            logger.warning("peer-memory all-reduce unavailable (%s); NCCL serves them all", exc)
            return None

    def fits(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.dtype == self.dtype
            and tensor.numel() <= self.capacity
            and tensor.is_contiguous()
        )

    def __call__(self, tensor: torch.Tensor, two_shot: bool | None = None) -> torch.Tensor:
        """Sum over ranks, in place (`fits(tensor)` must hold). `two_shot`: each rank sums
        its share of the elements, then all gather them (None: by size)."""
        symmetric = self.buffer[: tensor.numel()].view(tensor.shape)
        if two_shot is None:
            two_shot = tensor.numel() * tensor.element_size() >= TWO_SHOT_MIN_BYTES
        if two_shot:
            symmetric.copy_(tensor)
            self._two_shot(symmetric, "sum", self.group_name, tensor)
        else:
            self._one_shot(symmetric, tensor, "sum", self.group_name, tensor)
        return tensor

    @property
    def norm_rows(self) -> int:
        """The most rows a fused all-reduce + norm takes (0: none)."""
        if self.two_shot is not None:
            return self.two_shot.max_rows
        return self.lanes[-1].max_rows if self.lanes else 0

    def fits_norm(self, partial: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether `add_rms_norm` takes these."""
        return (
            partial.dtype == self.dtype
            and partial.dim() == 2
            and partial.shape[0] <= self.norm_rows
            and partial.shape[1] == self.hidden
            and partial.stride(-1) == 1
            and (residual is None or residual.stride(-1) == 1)
        )

    def add_rms_norm(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum over ranks of `partial` + residual) * weight, that sum + residual) in
        one kernel (`fits_norm` must hold), in the first lane with room for its rows: one-shot
        for decode batches, two-shot beyond (the residual and weight alike on every rank)."""
        from kvfleet.engine.parallel import triton_peer

        rows = partial.shape[0]
        lane = next((lane for lane in self.lanes if lane.max_rows >= rows), None)
        if lane is None:
            assert self.two_shot is not None
            return triton_peer.two_shot_add_rms_norm(
                partial,
                residual,
                weight,
                eps,
                self._bases,
                self.two_shot,
                self.rank,
                self.world_size,
            )
        return triton_peer.all_reduce_add_rms_norm(
            partial, residual, weight, eps, self._bases, lane, self.rank, self.world_size
        )


def _lane_shapes(lanes: tuple[int, ...] | None, max_rows: int) -> list[tuple[int, int]]:
    """(programs, rows it serves) of each lane needed for calls of up to `max_rows` rows: those
    with fewer programs than that, then the first with enough (or the largest, with several
    rows per program)."""
    from kvfleet.engine.parallel import triton_peer

    shapes: list[tuple[int, int]] = []
    for programs in sorted(lanes or triton_peer.LANES):
        if max_rows <= 0 or (shapes and shapes[-1][1] >= max_rows):
            break
        shapes.append((programs, min(programs, max_rows)))
    if shapes:
        shapes[-1] = (shapes[-1][0], max_rows)
    return shapes
