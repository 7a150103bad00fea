"""Exporting and importing KV blocks, so that a prefix computed by one engine is a prefix-cache hit
in another.

Importing a block means putting it in the prefix cache: it is copied into a free block, registered
under its chained hash (shardline/core/prefix_hash.py, the same in every process) and left at
ref count 0, evictable like any block a finished request left behind. A later request whose prompt
starts with those tokens then finds them through the normal admission path and prefills only the
rest. So every feature that moves KV (a drain's hand-off, disaggregated prefill, a shared tier)
only has to import blocks; none of them touches the scheduler.

Everything here runs on the engine's thread, between steps (the worker's engine loop calls it),
so no step reads or writes a block while it is copied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.model.config import ModelConfig
from shardline.core.prefix_hash import hash_block_tokens


class KvTransferError(ValueError):
    """Blocks refused; nothing of them was imported. The message names the field at fault."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class KvLayoutMismatch(KvTransferError):
    """The blocks come from another model, weight format, dtype or cache layout: their values would be wrong here."""


@dataclass(slots=True, frozen=True)
class KvLayout:
    """What must agree between two engines for one's KV blocks to be valid in the other's cache."""

    model: str  # the served model's name
    config_fingerprint: str  # of the model's whole config: the same name with another shape or rope is refused
    weight_format: str  # the weights that computed the KV ("gguf", "int8", "none": the model's dtype)
    dtype: str  # the KV cache's element type, e.g. "float32"
    block_size: int  # tokens per block
    num_layers: int  # decoder layers, each with its K and V
    num_kv_heads: int  # KV heads this rank holds
    head_dim: int  # values per head
    tp_size: int  # ranks the heads are split across

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's KV: [layer, K or V, token, KV head, value]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KvTransferError("dtype", f"{self.dtype!r} is not a torch dtype")
        return dtype

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.torch_dtype.itemsize

    def check_matches(self, incoming: KvLayout) -> None:
        """Raises KvLayoutMismatch naming every field in which `incoming` differs from this engine."""
        diffs = [
            f"{f.name} {getattr(incoming, f.name)!r} (here {getattr(self, f.name)!r})"
            for f in dataclasses.fields(self)
            if getattr(incoming, f.name) != getattr(self, f.name)
        ]
        if diffs:
            raise KvLayoutMismatch(diffs[0].split(" ", 1)[0], "blocks from another layout: " + ", ".join(diffs))


def config_fingerprint(config: ModelConfig) -> str:
    """A digest of the whole model config, stable across processes (sorted JSON, sha256)."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class KvBlocks:
    """A run of consecutive full blocks of one prefix chain, with their KV, on the host."""

    parent_hash: int | None  # the hash of the block before the first; None: the first starts the prompt
    token_ids: list[list[int]]  # per block: its block_size tokens (the importer checks each hash with them)
    block_hashes: list[int]  # per block: hash_block_tokens(the previous block's hash, its tokens)
    kv: torch.Tensor  # [blocks, layers, 2, block_size, kv heads, head_dim], contiguous, on the CPU
    # What the prompt's first block chains from: prefix_hash.chain_root of the LoRA adapter that
    # computed the KV, None for the base model. Only requests of that adapter then hit the blocks.
    chain_root: int | None = None

    @property
    def first_parent(self) -> int | None:
        """What the first block's hash chains from."""
        return self.parent_hash if self.parent_hash is not None else self.chain_root

    def __len__(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True, frozen=True)
class ImportResult:
    """What an import did with each block it was given."""

    imported: int  # copied into free blocks and registered in the prefix cache
    already_cached: int  # held by this cache already, left as they were
    no_room: int  # the chain's tail that found no free or evictable block: not imported


def check_blocks(blocks: KvBlocks, layout: KvLayout) -> None:
    """Refuses a payload whose sizes, dtype or hash chain are wrong, before anything is touched."""
    n = len(blocks.block_hashes)
    if len(blocks.token_ids) != n:
        raise KvTransferError("token_ids", f"{len(blocks.token_ids)} blocks of tokens for {n} block hashes")
    expected = (n, *layout.block_shape)
    if tuple(blocks.kv.shape) != expected:
        raise KvTransferError("kv", f"shape {tuple(blocks.kv.shape)}, expected {expected}")
    if blocks.kv.dtype != layout.torch_dtype:
        raise KvTransferError("kv", f"dtype {blocks.kv.dtype}, expected {layout.torch_dtype}")
    parent = blocks.first_parent
    for i, (tokens, block_hash) in enumerate(zip(blocks.token_ids, blocks.block_hashes)):
        if len(tokens) != layout.block_size:
            raise KvTransferError(f"token_ids[{i}]", f"{len(tokens)} tokens, a full block holds {layout.block_size}")
        parent = hash_block_tokens(parent, tokens)
        if parent != block_hash:
            raise KvTransferError(f"block_hashes[{i}]", "does not hash its parent and tokens: the chain is broken")


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The KV of `block_ids`, [blocks, layers, 2, block_size, heads, head_dim], copied to the host."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # Each layer's cache is [2, blocks, block_size, heads, head_dim]: one index_select per layer.
    per_layer = torch.stack([cache.index_select(1, index) for cache in kv_caches])
    return per_layer.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: list[int], kv: torch.Tensor) -> None:
    """Writes `kv` ([blocks, layers, ...], as gather_blocks gives it) into `block_ids` of every layer."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    on_device = kv.to(kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, on_device[:, layer].transpose(0, 1))


class KvTransfer:
    """Export and import against one engine's block pool and KV cache (one rank's: TP 1).

    Not thread-safe: call it from the engine's thread only, between steps.
    """

    def __init__(self, pool: BlockPool, kv_caches: Sequence[torch.Tensor], layout: KvLayout) -> None:
        self.pool = pool
        self.kv_caches = kv_caches
        self.layout = layout

    def export_prefix(self, token_ids: Sequence[int], chain_root: int | None = None) -> KvBlocks:
        """The full blocks of `token_ids` that this cache holds, from the first (possibly none); those
        computed with the LoRA adapter whose chain starts at `chain_root` (None: the base model)."""
        block_ids = self.pool.get_cached_prefix(token_ids, chain_root)
        size = self.layout.block_size
        tokens = [list(token_ids[i * size : (i + 1) * size]) for i in range(len(block_ids))]
        hashes = [self.pool.block_hash(b) for b in block_ids]
        assert all(h is not None for h in hashes)  # the prefix cache only returns hashed blocks
        return KvBlocks(None, tokens, [h for h in hashes if h is not None], self._gather(block_ids), chain_root)

    def export_sequence(
        self, token_ids: Sequence[int], block_ids: list[int], num_computed: int, chain_root: int | None = None
    ) -> KvBlocks:
        """The full, computed blocks of a running sequence (its tokens, its block table, how many of its
        tokens are in the cache and its chain's root), whether or not they are in the prefix cache."""
        size = self.layout.block_size
        num_full = min(len(block_ids), num_computed // size)
        tokens = [list(token_ids[i * size : (i + 1) * size]) for i in range(num_full)]
        hashes: list[int] = []
        parent = chain_root
        for block_tokens in tokens:
            parent = hash_block_tokens(parent, block_tokens)
            hashes.append(parent)
        return KvBlocks(None, tokens, hashes, self._gather(block_ids[:num_full]), chain_root)

    def import_blocks(self, layout: KvLayout, blocks: KvBlocks) -> ImportResult:
        """Registers `blocks` in the prefix cache, at ref count 0. Everything is checked before the pool
        is touched, so a refused payload leaves no trace; a chain longer than the room left is
        imported from its first block on, as far as it fits (the head of a prefix is what a hit needs)."""
        self.layout.check_matches(layout)
        check_blocks(blocks, self.layout)
        pool = self.pool
        if not pool.enable_prefix_caching:
            raise KvTransferError("enable_prefix_caching", "this engine has no prefix cache to import blocks into")
        pinned: list[int] = []
        if blocks.parent_hash is not None:
            parent = pool.cached_block(blocks.parent_hash)
            if parent is None:
                raise KvTransferError("parent_hash", "the block before the first is not cached here")
            pinned.append(parent)
        # Blocks held already stay as they are, pinned (with the parent) while the others are
        # allocated, so that making room never evicts a link of the chain being imported.
        held = [pool.cached_block(h) for h in blocks.block_hashes]
        pinned += [b for b in held if b is not None]
        pool.acquire(pinned)
        try:
            return self._import_missing(blocks, held)
        finally:
            pool.free(pinned)

    def _import_missing(self, blocks: KvBlocks, held: list[int | None]) -> ImportResult:
        pool = self.pool
        room = pool.num_free_blocks
        positions: list[int] = []  # chain positions to import
        end = len(held)  # the chain is imported up to here
        for i, block_id in enumerate(held):
            if block_id is None:
                if len(positions) == room:
                    end = i
                    break
                positions.append(i)
        block_ids = pool.allocate(len(positions))
        try:
            if positions:
                scatter_blocks(self.kv_caches, block_ids, blocks.kv[positions])
        except BaseException:
            pool.free(block_ids)  # never hashed: back to the free list, nothing registered
            raise
        for i, block_id in zip(positions, block_ids):
            parent = blocks.block_hashes[i - 1] if i > 0 else blocks.first_parent
            pool.cache_full_block(block_id, parent, blocks.token_ids[i])
        pool.free(block_ids)  # ref 0, hashed: evictable, like a finished request's full blocks
        already = sum(1 for b in held[:end] if b is not None)
        return ImportResult(len(positions), already, len(held) - end)

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        if not block_ids:
            return torch.empty((0, *self.layout.block_shape), dtype=self.layout.torch_dtype)
        return gather_blocks(self.kv_caches, block_ids)
