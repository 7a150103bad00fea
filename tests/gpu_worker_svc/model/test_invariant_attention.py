"""Batch-invariant attention: a query's result is the same bits however it was batched, chunked or padded."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from gpu_worker_svc.model.attention_metadata import StepBatch, build_step
from gpu_worker_svc.model.layers.invariant_attention import TILE, InvariantContext, invariant_attention

N, HQ, HKV, D = 700, 9, 3, 64  # the default model's heads


@pytest.fixture(scope="module")
def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(N, h, D, generator=g) for h in (HQ, HKV, HKV))  # one sequence, slot i = position i


def _chunk(qkv, start: int, end: int, extra_tiles: int = 0) -> torch.Tensor:
    """Queries [start, end) over positions [0, end), the keys padded by `extra_tiles` more tiles."""
    q, k, v = qkv
    length = (-(-end // TILE) + extra_tiles) * TILE
    slots = torch.arange(length).clamp(max=end - 1)[None]
    allowed = torch.ones(end - start, length, dtype=torch.bool).tril(start)[None]
    return invariant_attention(q[None, start:end], k, v, InvariantContext.of(slots, allowed, HKV))[0]


@pytest.fixture(scope="module")
def whole(qkv) -> torch.Tensor:
    return _chunk(qkv, 0, N)


def test_it_is_attention(qkv, whole):
    q, k, v = qkv
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    assert (whole - ref).abs().max() < 1e-5


def test_a_chunk_gives_the_bits_of_the_whole_prompt(qkv, whole):
    # Short chunks (2 or 3 positions: 6 or 9 rows, padded) and random ones, padded by up to 2 more tiles.
    rng = random.Random(1)
    cases = [(0, 2, 0), (0, 3, 1), (5, 7, 0), (10, 14, 0), (100, 103, 2), (63, 64, 0), (64, 65, 1)]
    for _ in range(40):
        end = rng.randrange(2, N + 1)
        cases.append((rng.randrange(0, end - 1), end, rng.randrange(0, 3)))
    for start, end, extra in cases:
        assert torch.equal(_chunk(qkv, start, end, extra), whole[start:end]), (start, end, extra)


def test_decodes_batched_give_the_bits_of_the_prefill(qkv, whole):
    q, k, v = qkv
    rng = random.Random(2)
    for batch in (1, 2, 3, 7, 16):
        positions = [rng.randrange(0, N) for _ in range(batch)]
        length = (-(-(max(positions) + 1) // TILE) + rng.randrange(0, 2)) * TILE
        slots = torch.stack([torch.arange(length).clamp(max=p) for p in positions])
        allowed = torch.stack([torch.arange(length) <= p for p in positions])[:, None]
        out = invariant_attention(q[positions][:, None], k, v, InvariantContext.of(slots, allowed, HKV))
        for i, p in enumerate(positions):
            assert torch.equal(out[i, 0], whole[p]), (batch, p)


def test_step_metadata_pads_every_context_to_whole_tiles():
    # A 70-token first chunk, a chunk after 30 cached tokens, and two decodes.
    batch = StepBatch(
        token_ids=torch.zeros(70 + 20 + 2, dtype=torch.long),
        num_computed=torch.tensor([0, 30, 59, 99]),
        num_new=torch.tensor([70, 20, 1, 1]),
        block_tables=torch.arange(4 * 8).view(4, 8),
    )
    _, meta = build_step(batch, block_size=16, invariant=True)
    assert meta.invariant and [g.shape[0] for g in meta.prefill_gather] == [128, 64]
    assert meta.prefill_mask[0].shape == (70, 128) and not meta.prefill_mask[0][69, 70:].any()
    assert meta.prefill_mask[1][0].sum() == 31 and meta.prefill_mask[1][19].sum() == 50
    assert meta.decode_gather.shape == (2, 128) and meta.decode_mask.view(2, -1).sum(1).tolist() == [60, 100]
