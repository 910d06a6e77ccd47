"""The Triton attention backend: the KV-cache write, and a step's attention in two kernels.

Decode rows (one query token each) take the GQA-grouped, split-KV kernel in `triton_decode.py`;
prompt chunks (many query tokens, causal, also attending to cached prefix blocks) the varlen
kernel in `triton_prompt.py`, which also takes a mixed step's decode rows where splitting them
off does not pay. The torch backend (`torch_backend.py`) is their reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvfleet.engine.attention.metadata import (
    AttentionLayer,
    AttentionMetadata,
    cache_views,
    kv_cache_is_fp8,
)
from kvfleet.engine.attention.triton_decode import (
    decode_attention,
    decode_leaving_splits,
    takes_raw_token,
)
from kvfleet.engine.attention.triton_prompt import paged_attention
from kvfleet.engine.layers.grid import next_power_of_2
from kvfleet.engine.layers.linear import SplitRows, UnnormalizedRow, takes_splits
from kvfleet.engine.layers.quantization.fp8 import QuantizedRows
from kvfleet.engine.layers.triton_rope import (
    QKNorm,
    RawToken,
    RotaryWrite,
    kv_cache_value,
    rotary_and_write_kv,
)

# One token's RoPE and cache write made by its qkv projection's one-row GEMV (`attend_projected`;
# False: the GEMV, then the RoPE + cache write kernel, as before; for A/B runs)
ROTARY_IN_QKV = True
# ... or, where the qkv layer cannot rotate (4/8-bit weights, LoRA) and q and k have no norms,
# its plain output for decode attention to rotate in registers and write k and v into the cache
# itself (`RawToken`), in place of the RoPE kernel after it (2.84 us a layer after the 4-bit
# GEMV: INT4 Llama-3-8B batch 1 2.588 -> 2.541 ms on the H200, then 2.535 -> 2.518 with the
# rotation's tables loaded before the attention's wait; bench/RESULTS.md session 43). Not with
# q/k norms: normalized there too, Qwen3-8B's and A3B's batch 1 were slower than with the
# GEMV's last program of each head normalizing (4.329 -> 4.356, 2.572 -> 2.601 ms).
TOKEN_IN_ATTENTION = True

if TYPE_CHECKING:
    from torch import nn

    from kvfleet.engine.layers.torch_layers import RMSNorm, RotaryEmbedding


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    kv_scales_ptr,  # [2] float32 (an FP8 cache's K and V scales)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,  # V's (token-minor in an FP8 cache's head-major blocks: `cache_views`)
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    dest = block * stride_cb + offset * stride_cs + head * stride_ch + d
    v_dest = block * stride_vcb + offset * stride_vcs + head * stride_vch + d * stride_vcd
    tl.store(k_cache_ptr + dest, kv_cache_value(k, kv_scales_ptr, 0, k_cache_ptr, FP8), mask=mask)
    tl.store(v_cache_ptr + v_dest, kv_cache_value(v, kv_scales_ptr, 1, v_cache_ptr, FP8), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k, v [num_tokens, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slots
    (an FP8 cache: divided by `kv_scales`)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = cache_views(kv_cache)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        kv_scales if kv_scales is not None else slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        FP8=kv_cache_is_fp8(kv_cache),
    )


def _qk_norm(qk_norms: tuple[RMSNorm, RMSNorm] | None) -> QKNorm | None:
    """What the Triton kernels take of a layer's q and k norms."""
    if qk_norms is None:
        return None
    q_norm, k_norm = qk_norms
    return QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, q_norm.offset)


class TritonAttention(AttentionLayer):
    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)

    def attend_projected(
        self,
        qkv_proj: nn.Module,
        hidden: torch.Tensor | QuantizedRows | UnnormalizedRow,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
        out_proj: nn.Module | None = None,
    ) -> torch.Tensor | SplitRows | None:
        """One token through the one-row Triton GEMV of a bf16/fp16 or e4m3 qkv projection
        (`forward_rotated`), which normalizes, rotates q and writes k and v into the cache as
        `rotary_and_write_kv` would (one kernel fewer a layer at batch 1), or, for a layer that
        cannot rotate and no q/k norms (`TOKEN_IN_ATTENTION`), through the layer as it is,
        decode attention taking its raw row (`RawToken`); the attention's splits left to
        `out_proj`'s GEMV to merge where it takes them (`takes_splits`; not between the pieces
        of a prompt graph). 4/8-bit weights do not rotate in their GEMV: its programs take
        contiguous columns of the packed words, and pairs (d, d + half) across a head made
        Llama-3-8B's batch 1 2.665 -> 3.045 ms on the H200 (bench/RESULTS.md session 31)."""
        row = hidden.x if isinstance(hidden, UnnormalizedRow) else hidden
        # (a layer whose one-row GEMV can: bf16/fp16 and e4m3 ones, not under LoRA)
        forward_rotated = getattr(qkv_proj, "forward_rotated", None)
        if isinstance(row, QuantizedRows) or not (
            ROTARY_IN_QKV and rotary.fused and row.is_cuda and row.shape[0] == 1
        ):
            return None
        cos, sin = rotary.caches(row.device)
        if 2 * cos.shape[1] != self.head_dim:  # (a partial rotation)
            return None
        alone = self.graph_break is None and metadata.max_seqlen_q == 1  # (decode, no break)
        raw = None
        if (TOKEN_IN_ATTENTION and alone and forward_rotated is None and qk_norms is None
                and isinstance(hidden, torch.Tensor)
                and takes_raw_token(kv_cache, self.head_dim)):  # fmt: skip
            qkv = qkv_proj(hidden).reshape(1, -1).contiguous()
            raw = RawToken(qkv, positions, cos, sin)
        elif forward_rotated is None:
            return None
        else:
            target = RotaryWrite(positions, cos, sin, *cache_views(kv_cache),
                                 metadata.slot_mapping, kv_scales, self.num_heads,
                                 self.num_kv_heads, _qk_norm(qk_norms))  # fmt: skip
            qkv = forward_rotated(hidden, target)
            if qkv is None:
                return None
        q = qkv[:, : self.num_heads * self.head_dim]
        leave = 0
        if out_proj is not None and alone and self.head_dim == next_power_of_2(self.head_dim):
            leave = takes_splits(out_proj, q, self.head_dim)  # (whole heads a GEMV tile)
        if leave or raw is not None:
            return decode_leaving_splits(
                q.view(1, self.num_heads, self.head_dim), kv_cache, metadata, self.scale,
                self.sliding_window, None, None, kv_scales, self.softcap, leave, raw,
            )  # fmt: skip
        return self.attend_or_break(
            q.view(1, self.num_heads, self.head_dim), kv_cache, metadata, kv_scales
        )

    def forward_rotary(
        self,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        """The q/k norms, RoPE and the cache write in one kernel (where the rotary one is
        fused)."""
        if not (rotary.fused and q.is_cuda):
            return super().forward_rotary(
                rotary, positions, q, k, v, kv_cache, metadata, kv_scales, qk_norms
            )
        cos, sin = rotary.caches(q.device)
        k_cache, v_cache = cache_views(kv_cache)
        rotary_and_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, metadata.slot_mapping,
                            kv_scales, _qk_norm(qk_norms))  # fmt: skip
        return self.attend_or_break(q, kv_cache, metadata, kv_scales)

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode rows (a decode-only step's, or a mixed step's first `num_decodes`) through
        the GQA-grouped decode kernel, the rest through the varlen one: one query token in
        the varlen kernel fills one row of a 64-row tile and reads its KV once per query head."""
        if metadata.max_seqlen_q == 1:  # a decode-only step (its kernel takes q's strides)
            return decode_attention(
                q,
                kv_cache,
                metadata,
                self.scale,
                self.sliding_window,
                out,
                kv_scales=kv_scales,
                softcap=self.softcap,
            )
        # (both kernels take q's strides: a view of the fused QKV output is read in place)
        out = q.new_empty(q.shape) if out is None else out
        decodes = metadata.num_decodes
        if decodes:
            decode_attention(
                q[:decodes],
                kv_cache,
                metadata,
                self.scale,
                self.sliding_window,
                out[:decodes],
                kv_scales=kv_scales,
                softcap=self.softcap,
            )
        return paged_attention(
            q,
            kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
            out,
            kv_scales,
            self.softcap,
            first_seq=decodes,
        )
