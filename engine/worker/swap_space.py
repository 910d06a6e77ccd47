"""Host memory for preempted requests' KV blocks: a preempted request is swapped out here
where it has room (its blocks copied before the next step's forward) and copied back into
fresh device blocks when it resumes, instead of recomputing its tokens.

Why swap: recomputing a token of an 8B model is ~16 GFLOP (~25 us of an H100 at prefill
rates), copying its KV out and back 2 x 128 KB (bf16; ~10 us over PCIe): the copy is the
cheaper way back for any request with computed tokens that the prefix cache does not hold
(those come back as prefix hits and are not copied).

How: a host block holds one device block of every layer (K and V), contiguous, so blocks with
consecutive host ids move in one transfer. Out: the device blocks are gathered, layer by layer,
into a staging buffer on the device, which is copied to the host blocks run by run; in: the
reverse. Transfers are queued on the current stream without the host waiting (pinned memory):
stream order puts a copy out after the last write of its blocks, and the step after it after
the copy. A staging buffer holds at most `STAGING_BYTES`: larger swaps go in chunks.
"""

from __future__ import annotations

import torch

from kvfleet.engine.core.scheduler_output import Swaps

# The device memory a swap stages at once (beside the KV pool: taken from the activations'
# headroom, which a step of 8k prompt tokens of an 8B model puts near 0.5 GB)
STAGING_BYTES = 64 << 20


class SwapSpace:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        """`num_blocks` host blocks, each holding one block of every layer of `kv_caches`
        (pinned for a CUDA cache)."""
        self.num_blocks = num_blocks
        self.layer_bytes = _layer_bytes(kv_caches)
        self.block_bytes = sum(self.layer_bytes)
        self.host = torch.empty(
            (num_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=kv_caches[0].is_cuda
        )
        self.chunk_blocks = max(1, STAGING_BYTES // self.block_bytes)

    @staticmethod
    def bytes_per_block(kv_caches: list[torch.Tensor]) -> int:
        """One block's bytes over every layer (K and V)."""
        return sum(_layer_bytes(kv_caches))

    @torch.inference_mode()
    def copy(self, kv_caches: list[torch.Tensor], swaps: Swaps) -> None:
        """Preempted requests' blocks out (device block, host block), then resumed ones' back
        in (host block, device block). Out before in: a resumed request may take device blocks
        a preempted one has just left. (Host blocks a resume frees are taken again only by a
        later step's swaps, queued after these.)"""
        out, into = swaps
        if not out and not into:  # (most steps)
            return
        layers = [c.view(torch.uint8).view(2, c.shape[1], -1) for c in kv_caches]  # (any dtype)
        pairs_out = sorted((host, device) for device, host in out)  # (runs of host ids)
        for begin in range(0, len(pairs_out), self.chunk_blocks):
            self._out(layers, pairs_out[begin : begin + self.chunk_blocks])
        pairs_in = sorted(into)
        for begin in range(0, len(pairs_in), self.chunk_blocks):
            self._in(layers, pairs_in[begin : begin + self.chunk_blocks])

    def _out(self, layers: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        staging = self._staging(layers[0].device, len(pairs))
        device_ids = torch.tensor([d for _, d in pairs], device=layers[0].device)
        for layer, part in zip(layers, self._layer_parts(staging), strict=True):
            part.copy_(layer[:, device_ids].transpose(0, 1))
        for (first, last), (begin, end) in _runs([h for h, _ in pairs]):
            self.host[first : last + 1].copy_(staging[begin:end], non_blocking=True)

    def _in(self, layers: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        staging = self._staging(layers[0].device, len(pairs))
        for (first, last), (begin, end) in _runs([h for h, _ in pairs]):
            staging[begin:end].copy_(self.host[first : last + 1], non_blocking=True)
        device_ids = torch.tensor([d for _, d in pairs], device=layers[0].device)
        for layer, part in zip(layers, self._layer_parts(staging), strict=True):
            layer[:, device_ids] = part.transpose(0, 1)

    def _staging(self, device: torch.device, num_blocks: int) -> torch.Tensor:
        return torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8, device=device)

    def _layer_parts(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's bytes of the staged blocks, as [blocks, 2 (K, V), bytes of one]."""
        parts, offset = [], 0
        for size in self.layer_bytes:
            parts.append(staging[:, offset : offset + size].view(len(staging), 2, size // 2))
            offset += size
        return parts


def _layer_bytes(kv_caches: list[torch.Tensor]) -> list[int]:
    """Each layer's bytes of one block (K and V)."""
    return [c[:, :1].numel() * c.element_size() for c in kv_caches]


def _runs(host_ids: list[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Sorted host ids split where they stop being consecutive: ((first id, last id), (start,
    end) in the list) for each run."""
    runs, start = [], 0
    for i in range(1, len(host_ids) + 1):
        if i == len(host_ids) or host_ids[i] != host_ids[i - 1] + 1:
            runs.append(((host_ids[start], host_ids[i - 1]), (start, i)))
            start = i
    return runs
