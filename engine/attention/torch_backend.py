"""The torch attention backend: the reference (CPU and CUDA) for faster backends.

Reads K/V from the paged cache through each sequence's block table, so prefix hits and chunked
prefill are exercised exactly as a paged kernel sees them.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kvfleet.engine.attention.metadata import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values at their slots. k, v: [num_tokens, Hkv, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttention:
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        block_size = kv_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            num_blocks = -(-seq_len // block_size)
            blocks = metadata.block_tables[i, :num_blocks].long()
            # [seq_len, Hkv, D] gathered from the sequence's blocks
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
            values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
            # [H, len, D]
            qi = q[start : start + query_len].transpose(0, 1)
            ki = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            vi = values.transpose(0, 1).repeat_interleave(group, dim=0)
            mask = self._mask(query_len, seq_len, q.device)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale)
            out[start : start + query_len] = oi.transpose(0, 1)
            start += query_len
        return out

    def _mask(self, query_len: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """[query_len, seq_len] bool, True where attending is allowed; None when all is."""
        if query_len == 1 and (self.sliding_window is None or seq_len <= self.sliding_window):
            return None
        # Query j sits at absolute position seq_len - query_len + j.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
        key_pos = torch.arange(seq_len, device=device)[None, :]
        allowed = key_pos <= query_pos
        if self.sliding_window is not None:
            allowed &= key_pos > query_pos - self.sliding_window
        return allowed
