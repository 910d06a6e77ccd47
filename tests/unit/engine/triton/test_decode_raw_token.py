"""Decode attention taking this step's token raw from a qkv layer that cannot rotate
(`RawToken`): q and k rotated in the kernel, k and v written into the cache by the split holding the
token, against the rotary write (`rotary_and_write_kv`) then the same decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvfleet.engine.attention import triton_decode  # noqa: E402
from kvfleet.engine.attention.metadata import cache_views  # noqa: E402
from kvfleet.engine.layers.linear import SplitRows  # noqa: E402
from kvfleet.engine.layers.torch_layers import RotaryEmbedding  # noqa: E402
from kvfleet.engine.layers.triton_gemv import gemv  # noqa: E402
from kvfleet.engine.layers.triton_rope import RawToken, rotary_and_write_kv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("seq_len", "num_splits", "leave"),
    [(60, 1, 0), (150, 3, 0), (700, 8, 0), (700, 8, 4), (150, 8, 4)],
)
def test_decode_taking_the_raw_token_gives_the_rotary_write_then_the_decode(
    attention_case: Callable[..., dict[str, Any]],
    dtype: torch.dtype,
    seq_len: int,
    num_splits: int,
    leave: int,
) -> None:
    """One sequence (4 q heads, 2 KV heads of 32), its token's qkv row raw: the same output
    (or unmerged splits) and the same cache, bit for bit, as `rotary_and_write_kv` then the
    decode; the token in a split's first tile or a later
    one, one split or several, merged in the kernel or left to the GEMV."""
    inputs = attention_case([1], [seq_len], num_heads=4, num_kv_heads=2, dtype=dtype, seed=3)
    metadata = inputs["metadata"]
    generator = torch.Generator().manual_seed(seq_len)
    qkv = torch.randn(1, 8 * 32, generator=generator).to(dtype)
    cos, sin = RotaryEmbedding(32, 1024, 10000.0).caches(torch.device("cpu"))
    positions = torch.tensor([seq_len - 1])
    scale = 32**-0.5
    args = (None, None, num_splits, None, None, leave)

    expected_cache = inputs["kv_cache"].clone()
    q = qkv[:, :128].clone().view(1, 4, 32)
    k, v = qkv[:, 128:192].view(1, 2, 32), qkv[:, 192:].view(1, 2, 32)
    rotary_and_write_kv(q, k, v, positions, cos, sin, *cache_views(expected_cache),
                        metadata.slot_mapping, None, None)  # fmt: skip
    expected = triton_decode.decode_leaving_splits(q, expected_cache, metadata, scale, *args)

    cache = inputs["kv_cache"].clone()
    raw = RawToken(qkv, positions, cos, sin)
    got = triton_decode.decode_leaving_splits(
        qkv[:, :128].view(1, 4, 32), cache, metadata, scale, *args, raw
    )
    assert torch.equal(cache, expected_cache)
    if leave:
        assert isinstance(got, SplitRows)
        assert isinstance(expected, SplitRows)
        assert torch.equal(got.lse[:, :leave], expected.lse[:, :leave])
        identity = torch.eye(128, dtype=dtype)  # (the rows and lse the GEMV reads, merged)
        assert torch.equal(gemv(got, identity), gemv(expected, identity))
    else:
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, expected)


def test_the_raw_token_is_taken_over_k_major_unquantized_caches_only(block_layout: str) -> None:
    """`takes_raw_token`: a bf16/fp16/fp32 cache whose V is K-major (not head-major blocks,
    whose V is token-minor, nor an FP8 cache), heads of a power of two."""
    cache = torch.zeros(2, 3, 16, 2, 32)
    assert triton_decode.takes_raw_token(cache, 32) == (block_layout == "token-major")
    assert not triton_decode.takes_raw_token(cache.to(torch.float8_e4m3fn), 32)
    assert not triton_decode.takes_raw_token(torch.zeros(2, 3, 16, 2, 48), 48)
