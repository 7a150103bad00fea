"""Across classes the order is strict: a waiting sequence of a better class preempts running ones of
a worse class, when the batch is full and when the blocks are short, and starts at once."""

from __future__ import annotations

from gpu_worker_svc.engine.sequence import Sequence, SequenceStatus
from tests.gpu_worker_svc.engine.test_batch_scheduler import step

LOW, HIGH = 5, 0  # a batch class and an interactive one


def seeded_token(seq: Sequence) -> int:
    # A function of (seed, index), as the seeded sampler is: a recompute must give the same tokens.
    return 500 + (seq.params.seed * 31 + seq.num_output_tokens * 7) % 97


def _chats(create_requests, n: int, num_tokens: int = 6, **fields) -> list[Sequence]:
    """Interactive sequences with prompts of their own: no prefix-cache hit on the batch's blocks."""
    prompts = [list(range(50_000 + 1000 * i, 50_000 + 1000 * i + num_tokens)) for i in range(n)]
    fields.setdefault("arrival_times", [10.0 + i for i in range(n)])
    return create_requests(n, prompts=prompts, prefix="chat", priorities=[HIGH] * n, **fields)


def _ids(out) -> list[str]:
    return [item.seq.request_id for item in out.scheduled]


def _full_batch(create_scheduler, create_requests, priorities: list[int], max_num_seqs: int = 0, **config):
    """A scheduler running sequences of `priorities`, each past its first decode; they take every
    seat unless `max_num_seqs` gives more."""
    sched = create_scheduler(max_num_seqs=max_num_seqs or len(priorities), **config)
    low = create_requests(len(priorities), num_tokens=6, max_tokens=8, priorities=priorities)
    for seq in low:
        sched.add(seq)
    for _ in range(4):
        if all(s.num_output_tokens >= 2 for s in low):
            break
        step(sched, seeded_token)
    assert sched.num_running == len(priorities) and all(s.num_output_tokens >= 2 for s in low)
    return sched, low


def test_a_better_class_preempts_the_newest_of_a_full_batch_and_runs_in_the_same_step(
    create_scheduler, create_requests
):
    sched, low = _full_batch(create_scheduler, create_requests, [LOW] * 4)
    (chat,) = _chats(create_requests, 1)
    sched.add(chat)
    out, upd = step(sched, seeded_token)
    assert out.preempted_ids == ["req3"]
    assert _ids(out) == ["req0", "req1", "req2", "chat0"]  # the victim's decode is taken back
    assert out.num_batched_tokens == 3 + 6 <= sched.config.max_num_batched_tokens
    assert chat.num_output_tokens == 1 and low[3].status == SequenceStatus.PREEMPTED
    assert sched.num_running == 4


def test_the_victim_is_the_lowest_class_then_the_newest(create_scheduler, create_requests):
    sched, _ = _full_batch(create_scheduler, create_requests, [5, 7, 7, 5])
    chats = _chats(create_requests, 2)
    for chat in chats:
        sched.add(chat)
    out, _ = step(sched, seeded_token)
    assert out.preempted_ids == ["req2", "req1"]  # class 7, newest first; the class-5 ones stay
    assert set(_ids(out)) == {"req0", "req3", "chat0", "chat1"}


def test_a_middle_class_preempts_only_a_worse_one(create_scheduler, create_requests):
    sched, _ = _full_batch(create_scheduler, create_requests, [3, 9, 3, 3])
    (mid,) = create_requests(1, num_tokens=6, prefix="mid", priorities=[6], arrival_times=[10.0])
    (other,) = create_requests(1, num_tokens=6, prefix="other", priorities=[6], arrival_times=[11.0])
    sched.add(mid)
    sched.add(other)
    out, _ = step(sched, seeded_token)
    assert out.preempted_ids == ["req1"]  # the only worse one; class 3 is better than class 6
    assert "mid0" in _ids(out) and "other0" not in _ids(out)


def test_an_equal_or_worse_class_waits_for_a_seat(create_scheduler, create_requests):
    sched, low = _full_batch(create_scheduler, create_requests, [LOW] * 4)
    same, worse = create_requests(2, num_tokens=6, prefix="late", priorities=[LOW, LOW + 1], arrival_times=[10, 11])
    sched.add(same)
    sched.add(worse)
    for _ in range(5):
        out, _ = step(sched, seeded_token)
        assert out.preempted_ids == [] and set(_ids(out)) == {s.request_id for s in low}
    assert same.status == SequenceStatus.WAITING and worse.status == SequenceStatus.WAITING


def test_short_blocks_preempt_a_worse_class_only_as_far_as_needed(create_scheduler, create_requests):
    # 12 blocks of 4: six sequences of 6 tokens hold two each after their first decodes.
    sched, low = _full_batch(create_scheduler, create_requests, [LOW] * 6, max_num_seqs=16, num_blocks=12)
    assert sched.block_pool.num_free_blocks == 0
    (chat,) = _chats(create_requests, 1, num_tokens=12)
    sched.add(chat)
    out, _ = step(sched, seeded_token)
    assert out.preempted_ids == ["req5", "req4"]  # its 3 blocks: two victims of two blocks each
    assert "chat0" in _ids(out) and chat.num_output_tokens == 1
    assert all(s.status == SequenceStatus.RUNNING for s in low[:4])


def test_an_equal_class_short_of_blocks_does_not_preempt(create_scheduler, create_requests):
    sched, _ = _full_batch(create_scheduler, create_requests, [LOW] * 6, max_num_seqs=16, num_blocks=12)
    (late,) = create_requests(1, num_tokens=12, prefix="late", priorities=[LOW], arrival_times=[10.0])
    sched.add(late)
    out, _ = step(sched, seeded_token)
    assert out.preempted_ids == [] and "late0" not in _ids(out)


def test_nothing_is_preempted_when_all_the_worse_ones_gone_would_not_make_room(create_scheduler, create_requests):
    # Without chunked prefill a prompt runs whole: 14 tokens, where the decodes of its own class
    # leave 16 - 3 even with the worse one's decode given back.
    sched, low = _full_batch(
        create_scheduler,
        create_requests,
        [HIGH, HIGH, HIGH, LOW],
        max_num_seqs=8,
        max_num_batched_tokens=16,
        enable_chunked_prefill=False,
    )
    (chat,) = _chats(create_requests, 1, num_tokens=14, max_tokens=2)
    sched.add(chat)
    out, _ = step(sched, seeded_token)
    assert out.preempted_ids == [] and low[3].status == SequenceStatus.RUNNING
    assert chat.status == SequenceStatus.WAITING


def test_a_preempted_sequence_resumes_from_the_prefix_cache_with_the_same_tokens(create_scheduler, create_requests):
    prompts = [list(range(100 + 1000 * i, 112 + 1000 * i)) for i in range(4)]
    # Alone, each sequence runs to its end without being preempted: the reference.
    reference = create_scheduler(max_num_seqs=4)
    for seq in create_requests(4, max_tokens=12, prompts=prompts, priorities=[LOW] * 4):
        reference.add(seq)
    expected = {s.request_id: s.output_token_ids for s in _run_to_end(reference)}

    sched = create_scheduler(max_num_seqs=4)
    low = create_requests(4, max_tokens=12, prompts=prompts, priorities=[LOW] * 4)
    for seq in low:
        sched.add(seq)
    for _ in range(6):
        step(sched, seeded_token)
    computed = low[3].num_computed_tokens
    chats = _chats(create_requests, 2, max_tokens=3)
    for chat in chats:
        sched.add(chat)
    out, _ = step(sched, seeded_token)
    assert sorted(out.preempted_ids) == ["req2", "req3"]
    resumed: dict[str, int] = {}
    finished = []
    while sched.has_unfinished:
        out, upd = step(sched, seeded_token)
        finished += upd.finished
        for item in out.scheduled:
            if item.seq.request_id in ("req2", "req3") and item.seq.request_id not in resumed:
                resumed[item.seq.request_id] = item.seq.num_cached_tokens
    assert resumed["req3"] >= (computed // 4) * 4  # its full blocks were kept in the cache
    assert {s.request_id: s.output_token_ids for s in low} == expected
    assert all(len(c.output_token_ids) == 3 for c in chats)
    assert sched.block_pool.num_used_blocks == 0


def test_interactive_requests_behind_a_full_batch_start_within_two_steps(create_scheduler, create_requests):
    """Counted in engine steps, not wall time: arrivals in bursts while a batch class fills every seat."""
    sched = create_scheduler(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=128)
    for seq in create_requests(12, num_tokens=8, max_tokens=40, priorities=[LOW] * 12):
        sched.add(seq)
    first_token_step: dict[str, int] = {}
    arrival_step: dict[str, int] = {}
    preempted = 0
    for n in range(30):
        if n in (4, 10, 11, 25):  # bursts of interactive arrivals, each behind a full batch
            assert sched.num_running == 8
            burst = _chats(create_requests, 3, num_tokens=10, max_tokens=4, arrival_times=[float(n)] * 3)
            for chat in burst:
                chat.request_id = f"{chat.request_id}-{n}"
                sched.add(chat)
                arrival_step[chat.request_id] = n
        out, upd = step(sched, seeded_token)
        preempted += len(out.preempted_ids)
        for seq, _ in upd.new_tokens:
            first_token_step.setdefault(seq.request_id, n)
    assert preempted > 0
    waits = {rid: first_token_step[rid] - arrival_step[rid] for rid in arrival_step}
    assert max(waits.values()) <= 1, waits  # its first token in the step it arrived before, or the next
    _run_to_end(sched)


def _run_to_end(sched) -> list[Sequence]:
    finished = []
    while sched.has_unfinished:
        out, upd = step(sched, seeded_token)
        assert out.scheduled
        finished += upd.finished
    return finished
