"""The hash chain that names a block of prompt tokens, shared by the engine's prefix cache and the
scheduler's prefix-affinity routing (so both sides agree without importing each other)."""

import hashlib
import struct
from collections.abc import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash one block's tokens, chained to the hash of the block before it.

    blake2b rather than hash(): the cluster scheduler recomputes these hashes in
    other processes for prefix-affinity routing, so they must not depend on
    PYTHONHASHSEED or the platform's byte order.
    """
    hasher = hashlib.blake2b(digest_size=8)
    # A leading tag keeps "no parent" distinct from a parent whose hash is 0.
    if parent_hash is None:
        hasher.update(b"\x00")
    else:
        hasher.update(b"\x01" + parent_hash.to_bytes(8, "little"))
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(hasher.digest(), "little")


def chain_root(identity: str) -> int:
    """The parent hash of a prompt's first block when its KV is computed with a LoRA adapter.

    Seeding the chain with the adapter's identity keeps two adapters, or an adapter and the base
    model (whose chain starts from None), from ever sharing a block, here and wherever blocks move.
    A tag of its own keeps it apart from any block hash.
    """
    hasher = hashlib.blake2b(digest_size=8)
    hasher.update(b"\x02" + identity.encode())
    return int.from_bytes(hasher.digest(), "little")
