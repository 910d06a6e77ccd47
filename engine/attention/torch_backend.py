"""The torch attention backend: the reference (CPU and CUDA) for faster backends.

NOTE: it computes in float32 whatever the model's dtype, rounding once at the end, so that it
stays an oracle for bf16 kernels rather than a second source of rounding.

Reads K/V from the paged cache through each sequence's block table, so prefix hits and chunked
prefill are exercised exactly as a paged kernel sees them.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kvfleet.engine.attention.metadata import (
    FP8_KV_MAX,
    AttentionLayer,
    AttentionMetadata,
    cache_views,
    kv_cache_is_fp8,
)


@torch.no_grad()  # (the cache is state: an indexed store into a view of it takes no history)
def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store this step's keys and values at their slots. k, v: [num_tokens, Hkv, D]; into an
    FP8 cache divided by their scale (saturating at e4m3's largest value)."""
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for part, (cache, x) in enumerate(zip(cache_views(kv_cache), (k, v), strict=True)):
        if kv_cache_is_fp8(kv_cache):
            assert kv_scales is not None, "an FP8 KV cache needs its scales"
            stored = (x.float() / kv_scales[part]).clamp(-FP8_KV_MAX, FP8_KV_MAX)
            # (indexing has no float8 kernel on every device: the bytes are copied as such)
            raw = stored.to(kv_cache.dtype).view(torch.uint8)
            cache.view(torch.uint8)[blocks, offsets] = raw
        else:
            cache[blocks, offsets] = x


class TorchAttention(AttentionLayer):
    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
        # Decode rows (one query token) run as one padded batch; prompt chunks one by one.
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_rows:
            rows = torch.tensor(decode_rows, device=q.device)
            token_index = metadata.cu_seqlens_q[rows].long()
            out[token_index] = self._decode(
                q[token_index], kv_cache, metadata, rows, decode_rows, kv_scales
            )
        starts = metadata.cu_seqlens_q.tolist()
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if query_len > 1:
                start = starts[i]
                out[start : start + query_len] = self._prefill(
                    q[start : start + query_len],
                    kv_cache,
                    metadata.block_tables[i],
                    seq_len,
                    kv_scales,
                )
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [num_decodes, Hq, D]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rows: torch.Tensor,
        decode_rows: list[int],
        kv_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        max_len = max(metadata.seq_lens_cpu[i] for i in decode_rows)
        keys, values = _gather(kv_cache, metadata.block_tables[rows], max_len, kv_scales)
        # [num_decodes, 1, max_len]: each query sees its own sequence (and window) only.
        key_pos = torch.arange(max_len, device=q.device)[None, :]
        seq_lens = metadata.seq_lens[rows].long()[:, None]
        allowed = key_pos < seq_lens
        if self.sliding_window is not None:
            allowed &= key_pos >= seq_lens - self.sliding_window
        out = self._attention(
            q[:, :, None, :].float(),  # [B, Hq, 1, D]
            keys.transpose(1, 2).float(),  # [B, Hkv, max_len, D]
            values.transpose(1, 2).float(),
            allowed[:, None, None, :],
        )
        return out[:, :, 0, :].to(q.dtype)

    def _prefill(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        kv_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [query_len, Hq, D] of one sequence whose KV length is `seq_len`."""
        keys, values = _gather(kv_cache, block_table[None], seq_len, kv_scales)
        query_len = q.shape[0]
        # Query j sits at absolute position seq_len - query_len + j.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = key_pos <= query_pos
        if self.sliding_window is not None:
            allowed &= key_pos > query_pos - self.sliding_window
        out = self._attention(
            q.transpose(0, 1).float(),  # [Hq, query_len, D]
            keys[0].transpose(0, 1).float(),  # [Hkv, seq_len, D]
            values[0].transpose(0, 1).float(),
            allowed,
        )
        return out.transpose(0, 1).to(q.dtype)

    def _attention(
        self,
        q: torch.Tensor,  # [..., Hq, Lq, D]
        k: torch.Tensor,  # [..., Hkv, Lk, D]
        v: torch.Tensor,
        allowed: torch.Tensor,  # broadcast to [..., Hq, Lq, Lk]
    ) -> torch.Tensor:
        """Softmax attention in float32; soft-capped scores spelled out (SDPA has no cap)."""
        if self.softcap is None:
            out: torch.Tensor = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=True
            )
            return out
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        scores = q @ k.transpose(-1, -2) * self.scale
        scores = self.softcap * torch.tanh(scores / self.softcap)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return weights @ v


def _gather(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    length: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [num_seqs, length, Hkv, D] read through block tables [num_seqs, *]
    (from an FP8 cache: float32, times their scales)."""
    block_size = kv_cache.shape[2]
    tables = block_tables[:, : -(-length // block_size)].long()
    key_cache, value_cache = cache_views(kv_cache)
    if kv_cache_is_fp8(kv_cache):  # (no float8 gather kernel on every device: bytes, then cast)
        assert kv_scales is not None, "an FP8 KV cache needs its scales"
        keys = key_cache.view(torch.uint8)[tables].view(kv_cache.dtype).float() * kv_scales[0]
        values = value_cache.view(torch.uint8)[tables].view(kv_cache.dtype).float() * kv_scales[1]
        return keys.flatten(1, 2)[:, :length], values.flatten(1, 2)[:, :length]
    keys = key_cache[tables].flatten(1, 2)[:, :length]
    values = value_cache[tables].flatten(1, 2)[:, :length]
    return keys, values
