"""AttentionMetadata: where each token of a flattened varlen batch reads and writes the KV cache."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from kvfleet.engine.layers.linear import SplitRows, UnnormalizedRow
    from kvfleet.engine.layers.quantization.fp8 import QuantizedRows
    from kvfleet.engine.layers.torch_layers import RMSNorm, RotaryEmbedding


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block 0
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: query token offsets
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length of each sequence after this step
    max_seqlen_q: int
    max_seqlen_k: int
    # Host copies for backends that loop on the CPU (the torch reference).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Of a mixed step, the first num_decodes sequences have one query token each (the runner
    # orders decodes first; `decodes_to_split`): a backend may send them to its decode kernel
    # and the rest to the varlen one. (0 in a decode-only step: all rows are decodes.)
    num_decodes: int = 0

    @classmethod
    def one_prompt(
        cls, slot_mapping: torch.Tensor, block_table: torch.Tensor, cached: int = 0
    ) -> AttentionMetadata:
        """One sequence whose prompt's last n tokens are this step, after `cached` ones: its
        tokens written at `slot_mapping` [n] int64, read through `block_table` [max_blocks]
        int32 (warm-up, profiling, scoring a text)."""
        n = int(slot_mapping.shape[0])
        device = slot_mapping.device
        # NOTE: separate tensors, not views of one: a pointer off 16-byte alignment is a
        # different Triton specialization, compiled again once serving starts.
        cu_seqlens_q = torch.tensor([0, n], dtype=torch.int32, device=device)
        total = n + cached
        seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
        return cls(slot_mapping, block_table[None], cu_seqlens_q, seq_lens, n, total, [n], [total])


def leading_decodes(query_lens: list[int]) -> int:
    """How many sequences at the front of a step have one query token each."""
    return next((row for row, n in enumerate(query_lens) if n != 1), len(query_lens))


# A mixed step's leading decodes go to the decode kernel when their KV holds at least this many
# tokens. Below it the varlen kernel's extra reads (~5 ns a KV token) cost less than the decode
# kernel's two launches a layer in an eager step, which is host-bound when small (prefix hits:
# 6 ms later without it; bench/RESULTS.md, "2026-11-27 (session 18)").
SPLIT_DECODES_MIN_KV_TOKENS = 32768


def decodes_to_split(query_lens: list[int], seq_lens: list[int]) -> int:
    """How many sequences at the front of a mixed step an attention backend sends to its
    decode kernel: the leading decodes, when their KV is large enough to pay for it."""
    decodes = leading_decodes(query_lens)
    return decodes if sum(seq_lens[:decodes]) >= SPLIT_DECODES_MIN_KV_TOKENS else 0


class AttentionLayer(abc.ABC):
    """What every backend is built from: one layer's head layout and attention window."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """`scale` of the scores (head_dim^-0.5 by default); `softcap`: scores become
        softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2)."""
        # NOTE: kv heads are shared by num_heads // num_kv_heads query heads (GQA).
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    # While PrefillGraphs (engine/worker/prefill_graphs.py) runs or captures a forward in
    # pieces: called in place of `attend`, with attend's arguments (the one point of a layer
    # that the pieces' graphs leave out).
    graph_break: Callable[..., torch.Tensor] | None = None

    @abc.abstractmethod
    def write(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,  # [2] float32 (K, V) for an FP8 cache
    ) -> None:
        """Write this step's K/V into the layer's cache (an FP8 (e4m3) cache stores K / k_scale
        and V / v_scale)."""

    @abc.abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] contiguous
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: `out` when given
        """Attend each query to its sequence's cached K/V (written already), an FP8 cache's read
        back times the scales."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the layer's cache, then attend each query to its sequence."""
        self.write(k, v, kv_cache, metadata, kv_scales)
        return self.attend_or_break(q, kv_cache, metadata, kv_scales)

    def attend_or_break(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.graph_break is not None:
            return self.graph_break(self, q, kv_cache, metadata, kv_scales)
        return self.attend(q, kv_cache, metadata, kv_scales)

    def attend_projected(
        self,
        qkv_proj: nn.Module,
        hidden: torch.Tensor | QuantizedRows | UnnormalizedRow,  # [num_tokens, hidden_size]
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
        out_proj: nn.Module | None = None,
    ) -> torch.Tensor | SplitRows | None:
        """The attention of one token whose q, k and v `qkv_proj` makes, normalizes (each head
        by `qk_norms`), rotates and writes into the cache in one kernel; None where this
        backend or this step cannot: the caller projects, then `forward_rotary`. `out_proj`:
        the layer the output goes into, which may be handed the output as `SplitRows` where
        its one-row GEMV merges them (`linear.takes_splits`)."""
        return None

    def forward_rotary(
        self,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> torch.Tensor:
        """`forward` after normalizing each head of q and k by `qk_norms` (Qwen3, Gemma 3) and
        rotating them (RoPE); a backend may do all of it in fewer kernels."""
        if qk_norms is not None:
            q, _ = qk_norms[0](q)
            k, _ = qk_norms[1](k)
        q, k = rotary(positions, q, k)
        return self.forward(q, k, v, kv_cache, metadata, kv_scales)


def kv_cache_is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.float8_e4m3fn


def head_major_blocks(kv_cache: torch.Tensor) -> bool:
    """Whether each block of the cache holds its bytes head by head, K as [num_kv_heads,
    block_size, head_dim] and V token-minor as [num_kv_heads, head_dim, block_size]: an FP8
    cache's do. The P.V product takes V in pairs of consecutive tokens; token-major, an 8-bit V
    reached them a byte at a time from shared memory (bench/RESULTS.md "2026-11-28 (session
    23)"), 16-bit values through `ldmatrix.trans`, which has no 8-bit form. Head by head, one
    head's K of a block is one run of block_size x head_dim bytes (2 KB at 16 x 128), not 16
    runs of 128 bytes a KV-heads' row apart."""
    return kv_cache_is_fp8(kv_cache)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer's cache [2, num_blocks, block_size, num_kv_heads, head_dim], each
    indexed [block, slot, head, dim] (strided where `head_major_blocks`). A block's bytes stay
    a block's, in either layout: swapping and copying blocks need no views."""
    keys, values = kv_cache[0], kv_cache[1]
    if head_major_blocks(kv_cache):
        _, block_size, heads, dim = values.shape
        per_block = block_size * heads * dim
        keys = keys.as_strided(keys.shape, (per_block, dim, dim * block_size, 1))
        values = values.as_strided(values.shape, (per_block, 1, dim * block_size, block_size))
    return keys, values


FP8_KV_MAX = 448.0  # (e4m3's largest finite value: stored K/V saturate there)
