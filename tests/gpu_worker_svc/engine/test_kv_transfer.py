"""Exporting KV blocks from one engine and importing them into another's prefix cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.kv_transfer import (
    KvBlocks,
    KvLayout,
    KvLayoutMismatch,
    KvTransfer,
    KvTransferError,
)
from gpu_worker_svc.engine.llm_engine import EngineConfig, LLMEngine
from gpu_worker_svc.engine.model_runner import RunnerConfig
from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.core.prefix_hash import chain_root, hash_block_tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)


def _engine(num_blocks: int = 32, **runner: object) -> LLMEngine:
    return LLMEngine(EngineConfig(RunnerConfig(num_blocks=num_blocks, **runner)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    """70 tokens: four full blocks of 16 and a partial fifth."""
    return torch.randint(100, 49152, (70,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def source(prompt):
    """The default model, having served `prompt` once: its four full blocks are in its prefix cache."""
    engine = _engine()
    engine.generate([prompt], GREEDY)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(prompt):
    """The prompt served by an engine that was given nothing."""
    engine = _engine()
    try:
        return engine.generate([prompt], GREEDY)[0]
    finally:
        engine.shutdown()


@pytest.fixture
def target():
    engine = _engine()
    yield engine
    engine.shutdown()


def _cache_state(engine: LLMEngine) -> tuple[int, int]:
    return engine.block_pool.num_cached_blocks, engine.block_pool.num_free_blocks


@pytest.mark.slow
def test_imported_blocks_are_prefix_hits_and_greedy_output_is_bit_identical(source, reference, target, prompt):
    blocks = source.export_prefix(prompt)
    assert len(blocks) == 4 and blocks.parent_hash is None
    assert tuple(blocks.kv.shape) == (4, 30, 2, 16, 3, 64)

    result = target.import_blocks(source.kv_layout, blocks)

    assert (result.imported, result.already_cached, result.no_room) == (4, 0, 0)
    assert target.block_pool.num_used_blocks == 0, "imported blocks wait at ref count 0, evictable"
    served = target.generate([prompt], GREEDY)[0]
    # Only the partial last block is prefilled: 64 of the 70 prompt tokens come from the import.
    assert (target.block_pool.prefix_cache_queries, target.block_pool.prefix_cache_hits) == (70, 64)
    assert served.token_ids == reference.token_ids
    assert served.logprobs == reference.logprobs, "the same logprobs, bit for bit"


@pytest.mark.slow
def test_a_running_request_exports_its_computed_blocks(source, target, prompt):
    source.add_request("running", prompt, dataclasses.replace(GREEDY, max_tokens=30))
    source.step()  # the prefill: 70 tokens computed, four blocks full
    blocks = source.export_request("running")
    source.abort_request("running", report=False)
    assert len(blocks) == 4
    assert torch.equal(blocks.kv, source.export_prefix(prompt).kv)
    assert target.import_blocks(source.kv_layout, blocks).imported == 4
    with pytest.raises(KeyError):
        source.export_request("unknown")


@pytest.mark.slow
def test_importing_blocks_held_already_changes_nothing(source, target, prompt):
    blocks = source.export_prefix(prompt)
    target.import_blocks(source.kv_layout, blocks)
    before = _cache_state(target)
    again = target.import_blocks(source.kv_layout, blocks)
    assert (again.imported, again.already_cached) == (0, 4)
    assert _cache_state(target) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "another-model"),
        ("config_fingerprint", "0" * 16),
        ("dtype", "bfloat16"),
        ("block_size", 32),
        ("num_layers", 29),
        ("num_kv_heads", 1),
        ("head_dim", 128),
        ("tp_size", 3),
    ],
)
def test_blocks_of_another_layout_are_refused_naming_the_field(source, target, prompt, field, value):
    blocks = source.export_prefix(prompt)
    before = _cache_state(target)
    with pytest.raises(KvLayoutMismatch) as refused:
        target.import_blocks(dataclasses.replace(source.kv_layout, **{field: value}), blocks)
    assert refused.value.field == field
    assert _cache_state(target) == before


@pytest.mark.slow
def test_blocks_computed_by_other_weights_are_refused(source, prompt):
    dequantized = _engine(num_blocks=8, quantization="none")
    try:
        with pytest.raises(KvLayoutMismatch, match="weight_format 'gguf' \\(here 'none'\\)"):
            dequantized.import_blocks(source.kv_layout, source.export_prefix(prompt))
        assert dequantized.block_pool.num_cached_blocks == 0
    finally:
        dequantized.shutdown()


def _corrupt(blocks: KvBlocks, how: str) -> KvBlocks:
    kv, tokens, hashes = blocks.kv, [list(t) for t in blocks.token_ids], list(blocks.block_hashes)
    if how == "short_tensor":
        kv = kv[:, :-1]
    elif how == "dtype":
        kv = kv.to(torch.float16)
    elif how == "missing_block":
        kv = kv[:-1]
    elif how == "token_changed":
        tokens[2][5] += 1
    elif how == "short_block":
        tokens[3] = tokens[3][:-1]
    elif how == "hashes_swapped":
        hashes[1], hashes[2] = hashes[2], hashes[1]
    return KvBlocks(blocks.parent_hash, tokens, hashes, kv)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, field",
    [
        ("short_tensor", "kv"),
        ("dtype", "kv"),
        ("missing_block", "kv"),
        ("token_changed", "block_hashes[2]"),
        ("short_block", "token_ids[3]"),
        ("hashes_swapped", "block_hashes[1]"),
    ],
)
def test_a_corrupt_payload_is_refused_and_nothing_is_imported(source, target, prompt, how, field):
    blocks = _corrupt(source.export_prefix(prompt), how)
    before = _cache_state(target)
    with pytest.raises(KvTransferError) as refused:
        target.import_blocks(source.kv_layout, blocks)
    assert refused.value.field == field
    assert _cache_state(target) == before
    assert target.block_pool.get_cached_prefix(prompt) == []


@pytest.mark.slow
def test_tensor_parallel_engines_refuse_kv_transfer(source, prompt):
    sharded = _engine(num_blocks=8, tp_size=3)
    try:
        with pytest.raises(ValueError, match="tp_size: KV transfer needs tp_size 1"):
            sharded.import_blocks(
                dataclasses.replace(source.kv_layout, num_kv_heads=1, tp_size=3), KvBlocks(None, [], [], torch.empty(0))
            )
    finally:
        sharded.shutdown()


# -- the pool's side, on a tiny layout: no model ---------------------------------------------------
LAYOUT = KvLayout("tiny", "f" * 16, "none", "float32", 4, 2, 1, 2, 1)


def _tiny(num_blocks: int) -> tuple[BlockPool, KvTransfer]:
    pool = BlockPool(num_blocks, LAYOUT.block_size)
    caches = [torch.zeros(2, num_blocks + 1, 4, 1, 2) for _ in range(LAYOUT.num_layers)]
    return pool, KvTransfer(pool, caches, LAYOUT)


def _chain(num_blocks: int, parent: int | None = None, first_token: int = 100, root: int | None = None) -> KvBlocks:
    tokens = [list(range(first_token + 4 * i, first_token + 4 * i + 4)) for i in range(num_blocks)]
    hashes = []
    parent = parent if parent is not None else root
    for block in tokens:
        parent = hash_block_tokens(parent, block)
        hashes.append(parent)
    kv = torch.arange(num_blocks * 2 * 2 * 4 * 2, dtype=torch.float32).view(num_blocks, *LAYOUT.block_shape)
    return KvBlocks(None, tokens, hashes, kv, root)


def test_a_chain_longer_than_the_room_is_imported_from_its_head():
    pool, transfer = _tiny(3)
    blocks = _chain(5)
    result = transfer.import_blocks(LAYOUT, blocks)
    assert (result.imported, result.already_cached, result.no_room) == (3, 0, 2)
    prompt = [t for block in blocks.token_ids for t in block]
    assert len(pool.get_cached_prefix(prompt)) == 3
    assert torch.equal(transfer.export_prefix(prompt).kv, blocks.kv[:3])


def test_making_room_never_evicts_a_link_of_the_chain_being_imported():
    pool, transfer = _tiny(3)
    blocks = _chain(3)
    first = KvBlocks(None, blocks.token_ids[:1], blocks.block_hashes[:1], blocks.kv[:1])
    transfer.import_blocks(LAYOUT, first)  # the chain's head is cached, evictable: the LRU block
    other = _chain(2, first_token=900)
    transfer.import_blocks(LAYOUT, other)  # the pool is full of evictable blocks now
    result = transfer.import_blocks(LAYOUT, blocks)
    assert (result.imported, result.already_cached, result.no_room) == (2, 1, 0)
    prompt = [t for block in blocks.token_ids for t in block]
    assert len(pool.get_cached_prefix(prompt)) == 3


def test_a_chain_that_continues_a_cached_block_needs_that_block_here():
    pool, transfer = _tiny(4)
    head, tail = _chain(1), _chain(1, parent=None, first_token=104)
    tail = KvBlocks(
        head.block_hashes[0], tail.token_ids, [hash_block_tokens(head.block_hashes[0], tail.token_ids[0])], tail.kv
    )
    with pytest.raises(KvTransferError, match="parent_hash: the block before the first is not cached here"):
        transfer.import_blocks(LAYOUT, tail)
    assert pool.num_cached_blocks == 0
    transfer.import_blocks(LAYOUT, head)
    assert transfer.import_blocks(LAYOUT, tail).imported == 1
    assert len(pool.get_cached_prefix(list(range(100, 108)))) == 2


def test_an_engine_without_prefix_caching_refuses_imports():
    pool = BlockPool(4, 4, enable_prefix_caching=False)
    transfer = KvTransfer(pool, [torch.zeros(2, 5, 4, 1, 2)] * 2, LAYOUT)
    with pytest.raises(KvTransferError, match="enable_prefix_caching"):
        transfer.import_blocks(LAYOUT, _chain(1))
    assert pool.num_free_blocks == 4


def test_blocks_of_a_lora_adapter_are_hits_for_that_adapter_only():
    pool, transfer = _tiny(4)
    root = chain_root("adapter-digest")
    blocks = _chain(2, root=root)
    assert transfer.import_blocks(LAYOUT, blocks).imported == 2
    prompt = [t for block in blocks.token_ids for t in block]
    assert len(pool.get_cached_prefix(prompt, root)) == 2
    assert pool.get_cached_prefix(prompt) == [] and pool.get_cached_prefix(prompt, chain_root("other")) == []
    exported = transfer.export_prefix(prompt, root)
    assert (exported.chain_root, exported.block_hashes) == (root, blocks.block_hashes)


def test_adapter_blocks_sent_as_the_base_models_are_refused():
    _, transfer = _tiny(4)
    blocks = dataclasses.replace(_chain(2, root=chain_root("adapter-digest")), chain_root=None)
    with pytest.raises(KvTransferError, match=r"block_hashes\[0\]: does not hash its parent and tokens"):
        transfer.import_blocks(LAYOUT, blocks)
