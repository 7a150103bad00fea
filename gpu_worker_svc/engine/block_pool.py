"""Ref-counted, fixed-size KV cache blocks with prefix caching by block hash."""

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from shardline.core.prefix_hash import hash_block_tokens

__all__ = ["BlockPool", "NoFreeBlocksError", "hash_block_tokens"]


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than are free or evictable."""


@dataclass(slots=True)
class KVBlock:
    block_id: int  # index into the KV cache tensors
    ref_count: int = 0  # sequences holding the block
    block_hash: int | None = None  # set while the block is in the prefix cache


class BlockPool:
    """A fixed pool of KV blocks.

    A block with references is in use. At ref count 0, a block whose full
    contents are registered in the prefix cache stays "evictable": it keeps its
    hash so a later request can reuse it, until an allocation needs it.
    Others return to the free list.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # Ref-0 cached blocks, least recently freed first: eviction pops the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self.blocks[block_id].block_hash

    def cached_block(self, block_hash: int) -> int | None:
        """The id of the block cached under `block_hash`, if any; takes no reference."""
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks with ref count 1, evicting LRU cached ones."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._uncache(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, given in sequence order.

        Blocks are released tail first, so a sequence's last blocks, the least
        likely to be shared with another prompt, are evicted before its first.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more times than taken")
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def get_cached_prefix(self, token_ids: Sequence[int], chain_root: int | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks prefixing token_ids.

        `chain_root`: what the first block's hash chains from (prefix_hash.chain_root of the LoRA
        adapter that computes them; None for the base model). Takes no references: call `acquire`
        on the blocks that will be used.
        """
        if not self.enable_prefix_caching:
            return []
        block_ids: list[int] = []
        parent_hash = chain_root
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + size])
            block_id = self._cached.get(parent_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cached blocks, making them unevictable."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if block.block_hash is None:
                    raise ValueError(f"block {block_id} is free, not cached")
                del self._evictable[block_id]
            block.ref_count += 1

    def cache_full_block(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Register a block that just became full; return its chained hash."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a full block holds {self.block_size} tokens, got {len(token_ids)}")
        block_hash = hash_block_tokens(parent_hash, token_ids)
        # When two requests computed the same block concurrently, the first one
        # stays the cached copy; the duplicate goes back to the free list later.
        if self.enable_prefix_caching and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.blocks[block_id].block_hash = block_hash
        return block_hash

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup; the scheduler calls it once per admission
        so that retries of a request that did not fit are not counted twice."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
