"""Chained block hashes: deterministic, chained, and keyed by extra keys."""

from __future__ import annotations

from kvfleet.engine.protocol.kv import ROOT_HASH, hash_block_tokens, hash_full_blocks


def test_hash_is_a_stable_sha256_layout() -> None:
    # Pinned: a gateway in another process or language must compute the same bytes.
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex()[:16] == "f45ae930310c74ad"


def test_chain_and_extra_keys() -> None:
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4)
    assert len(hashes) == 2  # the last 2 tokens are not a full block
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert hashes[0] != hash_block_tokens(ROOT_HASH, [0, 1, 2, 3], ("lora:a",))
    assert hash_block_tokens(ROOT_HASH, [1], ("a",)) != hash_block_tokens(ROOT_HASH, [1], ("b",))
    # Same tokens after a different parent: a different block.
    assert hash_block_tokens(hashes[0], [0, 1, 2, 3]) != hashes[0]
    # Known hashes are reused, the rest appended.
    assert hash_full_blocks([*tokens, 10, 11], 4, known=hashes) == hash_full_blocks(
        [*tokens, 10, 11], 4
    )


def test_the_packed_chain_is_block_by_block_hashing() -> None:
    tokens = [(7919 * i) % 128_256 for i in range(1_000)]
    keys = ("lora:sql", "salt:é")
    for extra in ((), keys):
        parent, want = ROOT_HASH, []
        for start in range(0, 992, 16):
            parent = hash_block_tokens(parent, tokens[start : start + 16], extra)
            want.append(parent)
        assert hash_full_blocks(tokens, 16, extra) == want
        assert hash_full_blocks(tokens, 16, extra, known=want[:10]) == want
        assert hash_full_blocks(tokens[:15], 16, extra) == []
