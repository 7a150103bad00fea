"""N-gram draft lookup, and the step layout of decodes that carry drafts: no model."""

from __future__ import annotations

import pytest
import torch

from gpu_worker_svc.engine.ngram_proposer import NgramIndex, SpeculativeConfig
from gpu_worker_svc.model.attention_metadata import StepBatch, build_step
from gpu_worker_svc.model.layers.attention import PagedAttention

BLOCK = 16


def test_the_longest_matching_tail_wins_and_its_latest_occurrence():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7]
    # Tail (5, 6, 7) occurred at 0..2, followed by 8 9 6 7; the shorter (6, 7) last at 5..6 (then 1)
    # loses to it.
    assert index.propose(tokens, 4) == [8, 9, 6, 7]
    assert index.propose(tokens, 2) == [8, 9]
    # Extended: the tail is now (7, 3): unseen; (3,) unseen too.
    assert index.propose(tokens + [3], 4) == []
    # A tail of one token: (6,) last ended at 3, followed by 7 6.
    assert NgramIndex(1, 3).propose([1, 2, 6, 7, 6], 3) == [7, 6]


def test_the_index_grows_with_the_tokens_and_never_proposes_past_the_end():
    index = NgramIndex(1, 2)
    tokens = [1, 2, 3]
    assert index.propose(tokens, 4) == []
    tokens += [1, 2]
    assert index.propose(tokens, 4) == [3, 1, 2]  # (1, 2) last ended at 2: tokens[2:] is all there is
    tokens += [3, 1]
    assert index.propose(tokens, 2) == [2, 3]
    assert index.num_indexed == len(tokens)


def test_a_repeated_token_drafts_its_own_run():
    index = NgramIndex(1, 3)
    assert index.propose([9, 4, 4, 4, 4], 8) == [4]  # (4, 4, 4) last ended at 3; then just the 4 at 4


def test_config_is_checked():
    SpeculativeConfig(4).validate()
    assert not SpeculativeConfig().enabled and SpeculativeConfig(2).enabled
    for bad in (SpeculativeConfig(-1), SpeculativeConfig(2, 1, 2), SpeculativeConfig(2, 3, 0)):
        with pytest.raises(ValueError):
            bad.validate()


def test_step_batches_carry_the_rows_they_sample_to_every_rank():
    tables = torch.arange(6).view(3, 2)
    batch = StepBatch(
        torch.arange(8), torch.tensor([0, 20, 30]), torch.tensor([3, 1, 4]), tables, num_logits=torch.tensor([1, 1, 4])
    )
    assert batch.logit_rows().tolist() == [2, 3, 4, 5, 6, 7]
    again = StepBatch.unpack(batch.pack())
    assert again.num_logits.tolist() == [1, 1, 4] and again.logit_rows().tolist() == [2, 3, 4, 5, 6, 7]
    plain = StepBatch.unpack(StepBatch(torch.arange(5), torch.tensor([0, 20]), torch.tensor([4, 1]), tables[:2]).pack())
    assert plain.num_logits is None and plain.logit_rows().tolist() == [3, 4]


def _batch(contexts: list[int], news: list[int], drafted: list[bool]) -> StepBatch:
    blocks = -(-(max(c + n for c, n in zip(contexts, news))) // BLOCK)
    tables = torch.randperm(256)[: len(contexts) * blocks].view(len(contexts), blocks)
    logits = [n if d else 1 for n, d in zip(news, drafted)]
    return StepBatch(
        torch.zeros(sum(news), dtype=torch.long),
        torch.tensor(contexts),
        torch.tensor(news),
        tables,
        num_logits=torch.tensor(logits) if any(drafted) else None,
    )


@pytest.mark.parametrize("contexts", [[40, 57, 33, 60], [40, 700, 33, 650]])  # one group; two groups
def test_drafts_attended_as_decodes_match_them_attended_as_chunks(contexts):
    """A decode's drafts go with the step's decodes, in one call of several queries each; each query
    must see what the same tokens see as a chunk of their own (the prefill path), causally."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    attention = PagedAttention(heads, kv_heads, dim)
    cache = torch.randn(2, 256, BLOCK, kv_heads, dim)
    news, drafted = [1, 4, 3, 1], [False, True, True, False]
    batch = _batch(contexts, news, drafted)
    _, meta = build_step(batch, BLOCK)
    assert meta.decode_queries == 4 and not meta.prefill_bounds
    assert len(meta.decode_groups) == (2 if max(contexts) > 100 else 0)
    assert meta.decode_index.tolist() == list(range(sum(news)))
    t = sum(news)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    as_decodes = attention(q, k, v, cache.clone(), meta)
    _, chunked = build_step(_same_tables(batch), BLOCK)  # no num_logits: the drafts' chunks are prefills
    assert chunked.decode_queries == 1 and len(chunked.prefill_bounds) == 2
    torch.testing.assert_close(as_decodes, attention(q, k, v, cache.clone(), chunked), rtol=1e-5, atol=1e-6)


def _same_tables(batch: StepBatch) -> StepBatch:
    return StepBatch(batch.token_ids, batch.num_computed, batch.num_new, batch.block_tables)


def test_invariant_steps_attend_drafts_as_chunks():
    _, meta = build_step(_batch([40, 57], [1, 3], [False, True]), BLOCK, invariant=True)
    assert meta.decode_queries == 1 and meta.prefill_bounds == [(1, 4)]
