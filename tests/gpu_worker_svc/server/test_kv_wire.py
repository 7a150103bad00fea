"""The KvChunk stream: blocks cut into slabs and put back, and bad framing refused."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.kv_transfer import KvBlocks, KvLayout, KvLayoutMismatch, KvTransferError
from gpu_worker_svc.server.kv_wire import KvAssembler, kv_chunks
from shardline.core.prefix_hash import chain_root, hash_block_tokens

LAYOUT = KvLayout("tiny", "f" * 16, "none", "bfloat16", 4, 3, 2, 8, 1)
LAYER_BYTES = 2 * 4 * 2 * 8 * 2  # K and V of 4 tokens, 2 heads of 8 bfloat16 values


def _blocks(n: int, parent: int | None = None) -> KvBlocks:
    tokens = [[10 * i + j for j in range(4)] for i in range(n)]
    hashes, h = [], parent
    for block in tokens:
        h = hash_block_tokens(h, block)
        hashes.append(h)
    kv = torch.randn((n, *LAYOUT.block_shape), generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    return KvBlocks(parent, tokens, hashes, kv)


def _assemble(chunks, max_blocks: int = 8) -> tuple[KvLayout, KvBlocks]:
    assembler = KvAssembler(max_blocks, LAYOUT)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


@pytest.mark.parametrize("slab_bytes, slabs_per_block", [(1 << 20, 1), (2 * LAYER_BYTES, 2), (1, 3)])
def test_blocks_survive_the_trip_whatever_the_slab_size(slab_bytes, slabs_per_block):
    sent = _blocks(3, parent=12345)
    chunks = list(kv_chunks(LAYOUT, sent, slab_bytes))
    assert len(chunks) == 1 + 3 * slabs_per_block
    assert all(len(c.slab.kv) <= max(slab_bytes, LAYER_BYTES) for c in chunks[1:])
    layout, received = _assemble(chunks)
    assert layout == LAYOUT
    assert (received.parent_hash, received.token_ids, received.block_hashes) == (
        12345,
        sent.token_ids,
        sent.block_hashes,
    )
    assert torch.equal(received.kv, sent.kv)


def test_the_chain_root_of_a_lora_adapters_blocks_survives_the_trip():
    root = chain_root("adapter-digest")
    sent = _blocks(2, parent=root)
    sent = KvBlocks(None, sent.token_ids, sent.block_hashes, sent.kv, root)
    _, received = _assemble(kv_chunks(LAYOUT, sent))
    assert (received.parent_hash, received.chain_root, received.block_hashes) == (None, root, sent.block_hashes)


def test_an_empty_transfer_is_a_header_alone():
    layout, received = _assemble(kv_chunks(LAYOUT, KvBlocks(None, [], [], torch.empty((0, *LAYOUT.block_shape)))))
    assert (layout, len(received), received.parent_hash) == (LAYOUT, 0, None)


def _refusal(chunks, max_blocks: int = 8) -> KvTransferError:
    with pytest.raises(KvTransferError) as refused:
        _assemble(chunks, max_blocks)
    return refused.value


def test_a_stream_cut_short_is_refused_whole():
    chunks = list(kv_chunks(LAYOUT, _blocks(2), 2 * LAYER_BYTES))
    assert "ended with 1 of 2 blocks complete" in str(_refusal(chunks[:-1]))
    assert "ended with 0 of 2 blocks complete" in str(_refusal(chunks[:2]))
    assert _refusal(chunks[1:]).field == "header"
    assert _refusal([]).field == "header"


def test_slabs_out_of_order_or_of_the_wrong_size_are_refused():
    chunks = list(kv_chunks(LAYOUT, _blocks(2), 2 * LAYER_BYTES))
    assert _refusal([chunks[0], chunks[3], chunks[1]]).field == "slab.block_index"
    assert _refusal([chunks[0], chunks[2]]).field == "slab.first_layer"
    chunks[1].slab.kv = chunks[1].slab.kv[:-1]
    assert _refusal(chunks).field == "slab.kv"


def test_a_header_of_another_layout_is_refused_before_any_buffer_is_made():
    chunks = list(kv_chunks(LAYOUT, _blocks(1)))
    chunks[0].header.num_layers = 1 << 30
    refused = _refusal(chunks)
    assert isinstance(refused, KvLayoutMismatch) and refused.field == "num_layers"


def test_a_second_header_or_more_blocks_than_the_cache_are_refused():
    chunks = list(kv_chunks(LAYOUT, _blocks(2)))
    assert _refusal([chunks[0], *chunks]).field == "header"
    assert _refusal(chunks, max_blocks=1).field == "header.num_blocks"
