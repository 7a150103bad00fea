import os
import subprocess
import sys

import pytest

from gpu_worker_svc.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens


def _fill_and_cache(pool: BlockPool, token_ids: list[int]) -> list[int]:
    """Allocate blocks for token_ids and register every full one, as the scheduler does."""
    size = pool.block_size
    block_ids = pool.allocate(-(len(token_ids) // -size))
    parent = None
    for i in range(len(token_ids) // size):
        parent = pool.cache_full_block(block_ids[i], parent, token_ids[i * size : (i + 1) * size])
    return block_ids


def test_hash_chain_depends_on_parent_and_tokens():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4])
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(root, [5, 6]) != hash_block_tokens(None, [5, 6])
    # A parent hash of 0 is not the same as no parent.
    assert hash_block_tokens(0, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert 0 <= root < 2**64


def test_hash_is_stable_across_processes():
    code = (
        "from gpu_worker_svc.engine.block_pool import hash_block_tokens;"
        "print(hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert int(out.stdout) == expected


def test_allocate_and_free_track_ref_counts():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.allocate(3)
    assert len(set(a)) == 3
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    assert all(pool.ref_count(b) == 1 for b in a)
    pool.free(a[:1])
    assert pool.ref_count(a[0]) == 0
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="freed more times"):
        pool.free(a[:1])


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert len(pool.allocate(1)) == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_cached_blocks_are_reused_across_requests():
    pool = BlockPool(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    first = _fill_and_cache(pool, prompt)
    assert pool.num_cached_blocks == 2

    # While the first request still holds them, a second one shares them.
    hits = pool.get_cached_prefix(prompt[:8] + [99, 98, 97, 96])
    assert hits == first[:2]
    pool.acquire(hits)
    assert [pool.ref_count(b) for b in hits] == [2, 2]

    pool.free(first)
    pool.free(hits)
    # The full blocks stay cached (evictable); the partial one is plain free.
    assert pool.num_free_blocks == 8
    assert pool.block_hash(first[2]) is None
    assert pool.get_cached_prefix(prompt) == first[:2]
    pool.acquire(first[:2])
    assert pool.num_free_blocks == 6
    assert pool.get_cached_prefix([0, 1, 2, 3, 9, 9, 9, 9]) == first[:1]
    assert pool.get_cached_prefix([7, 1, 2, 3, 4, 5, 6, 7]) == []


def test_prefix_lookup_stops_at_first_miss_and_ignores_partial_blocks():
    pool = BlockPool(num_blocks=8, block_size=4)
    blocks = _fill_and_cache(pool, list(range(12)))
    # Block 1 differs, so block 2 cannot match even though its tokens do:
    # its hash is chained to a different parent.
    assert pool.get_cached_prefix([0, 1, 2, 3, 0, 0, 0, 0, 8, 9, 10, 11]) == blocks[:1]
    assert pool.get_cached_prefix(list(range(7))) == blocks[:1]


def test_lru_eviction_order():
    pool = BlockPool(num_blocks=6, block_size=2)
    a = _fill_and_cache(pool, [1, 2, 3, 4])
    b = _fill_and_cache(pool, [5, 6, 7, 8])
    plain = pool.allocate(2)
    pool.free(a)
    pool.free(b)
    pool.free(plain)
    assert pool.num_free_blocks == 6
    # The free list is used before any cached block is evicted.
    assert sorted(pool.allocate(2)) == sorted(plain)
    # Then cached blocks go least recently freed first; within one sequence,
    # its tail block before its head.
    assert pool.allocate(1) == [a[1]]
    assert pool.get_cached_prefix([1, 2, 3, 4]) == a[:1]
    assert pool.allocate(1) == [a[0]]
    assert pool.get_cached_prefix([1, 2, 3, 4]) == []
    assert pool.allocate(2) == [b[1], b[0]]
    assert pool.num_cached_blocks == 0
    assert pool.block_hash(b[0]) is None


def test_acquire_refreshes_lru_position():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = _fill_and_cache(pool, [1, 2])
    b = _fill_and_cache(pool, [3, 4])
    pool.free(a)
    pool.free(b)
    pool.acquire(a)
    pool.free(a)  # a is now the most recently used
    pool.allocate(2)  # the two plain free blocks
    assert pool.allocate(1) == b


def test_acquire_rejects_free_uncached_block():
    pool = BlockPool(num_blocks=2, block_size=2)
    with pytest.raises(ValueError, match="not cached"):
        pool.acquire([0])


def test_duplicate_full_block_keeps_first_copy():
    pool = BlockPool(num_blocks=4, block_size=2)
    first = _fill_and_cache(pool, [1, 2])
    second = _fill_and_cache(pool, [1, 2])
    assert pool.get_cached_prefix([1, 2]) == first
    pool.free(second)
    # The duplicate was never registered, so it is plainly free, not evictable.
    assert pool.block_hash(second[0]) is None
    pool.free(first)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 1


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=False)
    blocks = _fill_and_cache(pool, [1, 2, 3, 4])
    assert pool.get_cached_prefix([1, 2, 3, 4]) == []
    pool.free(blocks)
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 4


def test_prefix_stats_counters():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.prefix_cache_hit_rate == 0.0
    pool.record_prefix_lookup(10, 0)
    pool.record_prefix_lookup(10, 5)
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (20, 5)
    assert pool.prefix_cache_hit_rate == 0.25


def test_cache_full_block_rejects_partial_block():
    pool = BlockPool(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="full block"):
        pool.cache_full_block(pool.allocate(1)[0], None, [1, 2])
