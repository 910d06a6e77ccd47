"""Host memory for preempted requests' KV blocks: a preempted request is swapped out here
where it has room (its blocks copied before the next step's forward) and copied back into
fresh device blocks when it resumes, instead of recomputing its tokens.

Why swap: recomputing a token of an 8B model is ~16 GFLOP (~25 us of an H100 at prefill
rates), copying its KV out and back 2 x 128 KB (bf16; ~10 us over PCIe): the copy is the
cheaper way back for any request with computed tokens that the prefix cache does not hold
(those come back as prefix hits and are not copied). The copies run synchronously on the
host (preemption is rare; admission keeps requests of known length from it).
"""

from __future__ import annotations

import torch

from kvfleet.engine.core.scheduler_output import Swaps


class SwapSpace:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        """`num_blocks` host blocks shaped as `kv_caches`' blocks (pinned for a CUDA cache)."""
        self.num_blocks = num_blocks
        self.host_caches = [
            torch.empty(
                (cache.shape[0], num_blocks, *cache.shape[2:]),
                dtype=cache.dtype,
                pin_memory=cache.is_cuda,
            )
            for cache in kv_caches
        ]

    @staticmethod
    def bytes_per_block(kv_caches: list[torch.Tensor]) -> int:
        """One block's bytes over every layer (K and V)."""
        return sum(c[:, :1].numel() * c.element_size() for c in kv_caches)

    @torch.inference_mode()
    def copy(self, kv_caches: list[torch.Tensor], swaps: Swaps) -> None:
        """Preempted requests' blocks out (device block, host block), then resumed ones' back
        in (host block, device block): stream-ordered after the step before, so a block is
        copied out after its last write and written again only after its copy; the host
        waits for the copies out (a later step may copy those host blocks back in)."""
        out, into = swaps
        for pairs, outward in ((out, True), (into, False)):
            if not pairs:
                continue
            first, second = zip(*pairs, strict=True)
            device_ids, host_ids = (first, second) if outward else (second, first)
            on_device = torch.tensor(device_ids, device=kv_caches[0].device)
            on_host = torch.tensor(host_ids)
            for layer, layer_host in zip(kv_caches, self.host_caches, strict=True):
                cache, host = layer.view(torch.uint8), layer_host.view(torch.uint8)  # (any dtype)
                if outward:
                    host[:, on_host] = cache[:, on_device].cpu()
                else:
                    cache[:, on_device] = host[:, on_host].to(cache.device)
