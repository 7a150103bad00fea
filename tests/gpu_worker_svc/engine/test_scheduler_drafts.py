"""The BatchScheduler with n-gram drafts: budgets, blocks, what update() keeps. No model."""

import pytest

from tests.gpu_worker_svc.engine.conftest import EOS
from tests.gpu_worker_svc.engine.test_batch_scheduler import plan, step


def _decoding(create_scheduler, create_requests, n: int = 2, **kwargs):
    """A scheduler whose n requests (prompts of 6 tokens) have prefilled and sampled their first token."""
    sched = create_scheduler(**{"max_num_batched_tokens": 64, **kwargs})
    seqs = create_requests(n, num_tokens=6, max_tokens=12)
    for seq in seqs:
        sched.add(seq)
    step(sched)
    assert all(s.num_output_tokens == 1 and s.num_computed_tokens == 6 for s in seqs)
    return sched, seqs


def test_a_decode_carries_its_drafts_and_keeps_those_confirmed(create_scheduler, create_requests):
    sched, (a, b) = _decoding(create_scheduler, create_requests)
    a.draft_token_ids = [7, 8, 9]
    out = sched.schedule()
    assert plan(out) == [("req0", 4, True), ("req1", 1, True)]
    assert out.scheduled[0].draft_token_ids == [7, 8, 9] and out.num_batched_tokens == 5
    assert len(a.block_ids) == 3  # positions 0..9 in blocks of 4
    # 7 and 8 were what sampling gave in their places; after 8 it gave 4, not the draft 9.
    update = sched.update(out, [[7, 8, 4], 11])
    assert [(s.request_id, t) for s, t in update.new_tokens] == [("req0", [7, 8, 4]), ("req1", [11])]
    # The first token and the confirmed drafts have their KV now; the one sampled last has not.
    assert a.output_token_ids[1:] == [7, 8, 4] and a.num_computed_tokens == 6 + 3 == a.num_tokens - 1
    assert b.num_computed_tokens == 7 == b.num_tokens - 1
    # Blocks full of computed tokens are hashed from the tokens that are really there.
    assert len(a.block_hashes) == 2


def test_update_refuses_tokens_that_do_not_follow_the_drafts(create_scheduler, create_requests):
    sched, (a, _) = _decoding(create_scheduler, create_requests)
    a.draft_token_ids = [7, 8]
    out = sched.schedule()
    for bad in ([8, 7, 1], [7, 8, 1, 2], []):
        with pytest.raises(ValueError, match="do not follow its drafts"):
            sched.update(out, [bad, 11])
    with pytest.raises(ValueError, match="do not follow"):
        sched.update(out, [[5, 6], [11, 12]])  # the other has no drafts


def test_a_stop_among_confirmed_drafts_ends_the_request_there(create_scheduler, create_requests):
    sched, (a, _) = _decoding(create_scheduler, create_requests)
    a.draft_token_ids = [7, EOS, 9]
    out = sched.schedule()
    update = sched.update(out, [[7, EOS, 9, 4], 11])
    assert update.new_tokens[0][1] == [7, EOS] and a.finish_reason == "stop"
    assert update.finished == [a] and a.block_ids == []


def test_drafts_take_only_the_budget_left_after_every_running_decode(create_scheduler, create_requests):
    sched, seqs = _decoding(create_scheduler, create_requests, n=3, max_num_seqs=3)
    sched.config.max_num_batched_tokens = 6
    seqs[0].draft_token_ids = [7, 8, 9, 10, 11]
    seqs[1].draft_token_ids = [7, 8]
    # 6 tokens: one for each decode, then the first one's drafts take the 3 left, the second's none.
    out = sched.schedule()
    assert plan(out) == [("req0", 4, True), ("req1", 1, True), ("req2", 1, True)]
    assert out.scheduled[1].draft_token_ids == [] and seqs[1].draft_token_ids == []  # used up or dropped


def test_drafts_never_take_the_block_a_later_decode_needs(create_scheduler, create_requests):
    """5 blocks of 4: a (6-token prompt) and b (8) hold 2 each after their first token; b's next
    position needs the last free block. a's drafts must not take it and make someone be preempted."""
    sched = create_scheduler(num_blocks=5)
    a, b = create_requests(2, max_tokens=12, prompts=[list(range(100, 106)), list(range(200, 208))])
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.block_pool.num_free_blocks == 1
    a.draft_token_ids = [7, 8, 9]
    out = sched.schedule()
    # b takes the free block; a's drafts fit where its own last block has room: one slot.
    assert plan(out) == [("req0", 2, True), ("req1", 1, True)] and not out.preempted_ids
    assert out.scheduled[0].draft_token_ids == [7]
    assert len(a.block_ids) == 2 and len(b.block_ids) == 3


def test_drafts_never_delay_an_admission(create_scheduler, create_requests):
    """Without chunked prefill a prompt needs its whole length of budget: drafts come after it."""
    sched = create_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False, max_num_seqs=2)
    a, b = create_requests(2, max_tokens=1, prompts=[list(range(100, 106)), list(range(200, 215))])
    a.params.max_tokens = 10  # prompt + max_tokens within the budget, as add() requires here
    sched.add(a)
    step(sched)
    sched.add(b)
    a.draft_token_ids = [7, 8]
    out = sched.schedule()
    assert plan(out) == [("req0", 1, True), ("req1", 15, True)]
    a.draft_token_ids = [7, 8]
    sched.update(out, [3, 4])
    assert plan(sched.schedule()) == [("req0", 3, True)]  # alone again: its drafts have the room


def test_a_prefill_chunk_never_takes_drafts(create_scheduler, create_requests):
    sched = create_scheduler(max_num_batched_tokens=4, max_num_seqs=1)
    (seq,) = create_requests(1, num_tokens=6)
    sched.add(seq)
    seq.draft_token_ids = [1, 2]
    step(sched)
    assert plan(sched.schedule()) == [("req0", 2, True)]
