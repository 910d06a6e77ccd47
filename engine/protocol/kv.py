"""The KV-cache contract between engines and the gateway: chained block hashes for the prefix
cache, hash(parent, token ids, extra keys), and the KV event and snapshot bodies.

Deterministic across processes and machines (sha256 over a fixed byte layout), so a gateway
hashing the same tokens finds the same blocks an engine reports in its KV events.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Literal, NewType

from kvfleet.engine.protocol.base import OpenAIBaseModel

BlockHash = NewType("BlockHash", bytes)

# The parent of a request's first block.
ROOT_HASH = BlockHash(b"\x00" * 32)


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<I{len(token_ids)}Q", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode()
        digest.update(struct.pack("<I", len(encoded)) + encoded)
    return BlockHash(digest.digest())


def extra_keys_for(lora_name: str | None, cache_salt: str | None) -> tuple[str, ...]:
    """The extra hash keys of a request: requests that differ here never share blocks. The
    gateway builds them the same way to find which engine holds a prompt's blocks."""
    keys = []
    if lora_name is not None:
        keys.append(lora_key(lora_name))
    if cache_salt is not None:
        keys.append(f"salt:{cache_salt}")
    return tuple(keys)


_LORA_PREFIX = "lora:"


def lora_key(lora_name: str) -> str:
    """An adapter's extra key (KV events carry it; unloading drops its blocks by it)."""
    return _LORA_PREFIX + lora_name


def adapter_of(extra_keys: Sequence[str]) -> str | None:
    """The adapter named in a block's extra keys, if any."""
    return next(
        (k.removeprefix(_LORA_PREFIX) for k in extra_keys if k.startswith(_LORA_PREFIX)), None
    )


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, reusing the first `len(known)` already known:
    each `hash_block_tokens(parent, block, extra_keys)`, from the tokens packed once (a third
    less host time on a 3k-token prompt than block by block)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else ROOT_HASH
    first, end = len(hashes) * block_size, len(token_ids) // block_size * block_size
    if end <= first:
        return hashes
    packed = struct.pack(f"<{end - first}Q", *token_ids[first:end])
    count = struct.pack("<I", block_size)
    keys = b"".join(struct.pack("<I", len(k.encode())) + k.encode() for k in extra_keys)
    width = 8 * block_size
    for offset in range(0, len(packed), width):
        digest = hashlib.sha256(parent)
        digest.update(count)
        digest.update(packed[offset : offset + width])
        digest.update(keys)
        parent = BlockHash(digest.digest())
        hashes.append(parent)
    return hashes


class KVEvent(OpenAIBaseModel):
    """One prefix-cache change on an engine; `seq` increases by one per event."""

    seq: int
    type: Literal["stored", "removed", "cleared"]
    block_hash: str | None = None  # hex sha256
    parent_hash: str | None = None
    token_count: int | None = None
    adapter: str | None = None


class KVSnapshot(OpenAIBaseModel):
    """The cached blocks as of event `seq`; resume the event stream from seq + 1."""

    seq: int
    block_size: int
    blocks: list[KVEvent]
