import random
from collections.abc import Callable

import pytest

from gpu_worker_svc.engine.batch_scheduler import BatchScheduler, SchedulerConfig, SchedulerOutput, StepUpdate
from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence, SequenceStatus
from tests.gpu_worker_svc.engine.conftest import EOS


def fake_token(seq: Sequence) -> int:
    # Depends only on the token index, like the seeded sampler, and never EOS.
    return 500 + seq.num_output_tokens


def step(sched: BatchScheduler, token_fn: Callable[[Sequence], int] = fake_token) -> tuple[SchedulerOutput, StepUpdate]:
    out = sched.schedule()
    sampled = [token_fn(s.seq) if s.needs_sample else None for s in out.scheduled]
    return out, sched.update(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.seq.request_id, s.num_new_tokens, s.needs_sample) for s in out.scheduled]


def run_to_end(sched: BatchScheduler, max_steps: int = 1000) -> list[Sequence]:
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return finished
        out, upd = step(sched)
        assert out.scheduled, "a step with unfinished requests must make progress"
        finished.extend(upd.finished)
    raise AssertionError("requests did not finish")


def test_chunked_prefill_mixes_with_decodes(create_scheduler, create_requests):
    sched = create_scheduler(max_num_batched_tokens=16)
    prompts = [list(range(100, 104)), list(range(1000, 1040))]
    short, long_ = create_requests(2, max_tokens=10, prompts=prompts)
    sched.add(short)
    sched.add(long_)
    plans = [plan(step(sched)[0]) for _ in range(4)]
    assert plans == [
        [("req0", 4, True), ("req1", 12, False)],
        [("req0", 1, True), ("req1", 15, False)],
        [("req0", 1, True), ("req1", 13, True)],
        [("req0", 1, True), ("req1", 1, True)],
    ]
    assert long_.num_computed_tokens == 41 and long_.num_output_tokens == 2
    assert len(long_.block_ids) == 11  # positions 0..40 need ceil(41 / 4) blocks


def test_max_num_seqs_limits_running(create_scheduler, create_requests):
    sched = create_scheduler(max_num_seqs=2)
    for seq in create_requests(5, num_tokens=4):
        sched.add(seq)
    out, _ = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["req0", "req1"]
    assert (sched.num_running, sched.num_waiting) == (2, 3)


def test_without_chunking_a_prompt_waits_for_budget(create_scheduler, create_requests):
    sched = create_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    for seq in create_requests(2, num_tokens=10, max_tokens=6):
        sched.add(seq)
    assert plan(step(sched)[0]) == [("req0", 10, True)]
    assert plan(step(sched)[0]) == [("req0", 1, True), ("req1", 10, True)]


def test_prefix_cache_reuse(create_scheduler, create_requests):
    sched = create_scheduler(num_blocks=16)
    prompt = list(range(100, 110))
    # The same first two blocks with a different tail, then exactly those blocks.
    prompts = [prompt, prompt[:9] + [7], prompt[:8]]
    first, second, third = create_requests(3, max_tokens=4, prompts=prompts)
    sched.add(first)
    step(sched)
    sched.add(second)
    sched.add(third)
    out, _ = step(sched)
    assert plan(out) == [("req0", 1, True), ("req1", 2, True), ("req2", 4, True)]
    assert second.num_cached_tokens == 8 and second.block_ids[:2] == first.block_ids[:2]
    # A fully cached prompt still computes its last block, to have logits.
    assert third.num_cached_tokens == 4 and third.block_ids[0] == first.block_ids[0]
    assert third.block_ids[1] != first.block_ids[1]
    assert out.num_prefix_cached_tokens == 12
    pool = sched.block_pool
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (28, 12)
    assert pool.ref_count(first.block_ids[0]) == 3


def test_preemption_victim_is_lowest_priority_then_newest(create_scheduler, create_requests):
    sched = create_scheduler(num_blocks=4)
    seqs = create_requests(3, num_tokens=4, priorities=[0, 1, 0])
    for seq in seqs:
        sched.add(seq)
    step(sched)  # one block each; every decode now needs a second block
    out, _ = step(sched)
    assert out.preempted_ids == ["req1"]
    assert plan(out) == [("req0", 1, True), ("req2", 1, True)]
    assert seqs[1].status == SequenceStatus.PREEMPTED and seqs[1].block_ids == []
    assert seqs[1].num_computed_tokens == 0 and seqs[1].output_token_ids == [500]


def test_equal_priority_preempts_newest_even_itself(create_scheduler, create_requests):
    sched = create_scheduler(num_blocks=3)
    seqs = create_requests(2, num_tokens=4)
    for seq in seqs:
        sched.add(seq)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_ids == ["req1"]
    assert plan(out) == [("req0", 1, True)]
    assert sched.num_waiting == 1


def test_preempting_an_already_scheduled_seq_unschedules_it(create_scheduler, create_requests):
    sched = create_scheduler(num_blocks=3)
    prompts = [[100, 101, 102], [200, 201, 202, 203]]
    low, high = create_requests(2, max_tokens=5, priorities=[5, 0], prompts=prompts)
    sched.add(low)
    step(sched)
    sched.add(high)
    step(sched)  # low decodes within its block, high is admitted: one block left
    out, _ = step(sched)  # low takes the last block, then high needs one
    assert out.preempted_ids == ["req0"]
    assert plan(out) == [("req1", 1, True)]
    assert out.num_batched_tokens == 1
    assert low.status == SequenceStatus.PREEMPTED


def test_preempted_request_resumes_and_finishes(create_scheduler, create_requests):
    sched = create_scheduler(num_blocks=4)
    seqs = create_requests(3, num_tokens=4, max_tokens=6)
    for seq in seqs:
        sched.add(seq)
    preempted = set()
    finished = []
    while sched.has_unfinished:
        out, upd = step(sched)
        preempted.update(out.preempted_ids)
        finished.extend(upd.finished)
    assert preempted
    assert {s.request_id for s in finished} == {"req0", "req1", "req2"}
    for seq in seqs:
        assert seq.output_token_ids == [500 + i for i in range(6)]
        assert seq.finish_reason == "length"
    assert sched.block_pool.num_free_blocks == 4


def test_priorities_order_admission(create_scheduler, create_requests):
    sched = create_scheduler(max_num_seqs=1)
    for seq in create_requests(3, num_tokens=4, max_tokens=1, priorities=[2, 0, 1]):
        sched.add(seq)
    order = [s.request_id for s in run_to_end(sched)]
    assert order == ["req1", "req2", "req0"]


@pytest.mark.parametrize("when", ["waiting", "running", "mid_prefill", "between_steps"])
def test_abort_frees_every_block(create_scheduler, create_requests, when):
    sched = create_scheduler(num_blocks=16, max_num_batched_tokens=16)
    other, victim = create_requests(2, num_tokens=12)
    sched.add(other)
    sched.add(victim)
    out = None
    if when == "running":
        step(sched)
        step(sched)
    elif when == "mid_prefill":
        step(sched)
        assert 0 < victim.num_computed_tokens < victim.num_tokens
    elif when == "between_steps":
        step(sched)
        out = sched.schedule()
    aborted = sched.abort("req1")
    assert aborted is victim and victim.finish_reason == "abort"
    assert victim.status == SequenceStatus.FINISHED_ABORTED and victim.block_ids == []
    assert sched.get("req1") is None and sched.abort("req1") is None
    if out is not None:
        sampled = [fake_token(s.seq) if s.needs_sample else None for s in out.scheduled]
        upd = sched.update(out, sampled)
        assert all(seq is not victim for seq, _ in upd.new_tokens)
    while sched.has_unfinished:
        out, _ = step(sched)
        assert all(item.seq is not victim for item in out.scheduled)
    sched.abort("req0")
    assert sched.block_pool.num_free_blocks == 16 and not sched.has_unfinished


def test_pressure_loop_every_request_finishes(create_scheduler, create_requests):
    rng = random.Random(0)
    sched = create_scheduler(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=16)
    shared = list(range(100, 110))
    seqs = create_requests(10, num_tokens=5) + create_requests(
        6, prompts=[shared[: rng.randint(3, 10)] for _ in range(6)], prefix="shared"
    )
    for seq in seqs:
        seq.params.max_tokens = rng.randint(1, 14)
        seq.priority = rng.randint(0, 2)
        sched.add(seq)
    pool = sched.block_pool
    finished, preemptions = [], 0
    for _ in range(2000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert out.scheduled
        assert out.num_batched_tokens <= 16 and len(out.scheduled) <= 6
        preemptions += len(out.preempted_ids)
        for item in out.scheduled:
            assert len(item.seq.block_ids) * 4 >= item.seq.num_computed_tokens + item.num_new_tokens
        held = sum(len(s.block_ids) for s in seqs if s.status == SequenceStatus.RUNNING)
        assert sum(pool.ref_count(b) for b in range(pool.num_blocks)) == held
        sampled = [fake_token(s.seq) if s.needs_sample else None for s in out.scheduled]
        finished.extend(sched.update(out, sampled).finished)
    assert preemptions > 0
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    for seq in seqs:
        assert seq.num_output_tokens == seq.params.max_tokens
        assert seq.output_token_ids == [500 + i for i in range(seq.params.max_tokens)]
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0


def test_the_longest_sequence_is_the_kv_caches_or_without_chunking_a_steps_budget(create_scheduler):
    # The engine's context (LLMEngine.max_model_len), which the worker's edge checks requests against.
    assert create_scheduler(num_blocks=4, max_num_batched_tokens=16).longest_sequence == 16  # 4 blocks of 4
    # Without chunked prefill a preempted sequence is recomputed in one prefill: it must fit a step.
    assert create_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False).longest_sequence == 16
    assert create_scheduler(num_blocks=2, max_num_batched_tokens=16, enable_chunked_prefill=False).longest_sequence == 8


def test_add_fixes_a_seed(create_scheduler, create_requests):
    seq = create_requests(1)[0]
    seq.params.seed = None
    create_scheduler().add(seq)
    assert isinstance(seq.params.seed, int)


def test_config_rejects_budget_below_max_num_seqs(create_scheduler):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        create_scheduler(max_num_seqs=8, max_num_batched_tokens=4)


def test_config_knows_when_new_requests_fill_a_step():
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100)
    assert not config.fills_a_step([])
    assert not config.fills_a_step([50, 49])
    assert config.fills_a_step([50, 50])  # the token budget
    assert config.fills_a_step([1, 1, 1])  # every sequence slot


def test_reported_cache_hits_are_prompt_tokens_of_the_first_admission():
    # After a preemption, the recompute hits its own output's blocks too: usage must still report
    # prompt tokens only (cached_tokens never exceeds prompt_tokens).
    scheduler = BatchScheduler(SchedulerConfig(8, 64, True), BlockPool(9, 4))
    seqs = [
        Sequence(
            name,
            list(range(base, base + n)),
            SamplingParams(max_tokens=m, seed=1),
            eos_token_id=EOS,
            arrival_time=float(i),
        )
        for i, (name, base, n, m) in enumerate((("A", 100, 6, 20), ("B", 200, 6, 12), ("C", 300, 2, 14)))
    ]
    for seq in seqs:
        scheduler.add(seq)
    token, preempted, readmitted_hits = 500, set(), 0
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        preempted |= set(out.preempted_ids)
        readmitted_hits = max(
            [readmitted_hits, *(s.seq.num_cached_tokens for s in out.scheduled if s.seq.request_id in preempted)]
        )
        scheduler.update(out, [(token := token + 1) if s.needs_sample else None for s in out.scheduled])
    assert preempted and readmitted_hits > 6  # a re-admission did hit output blocks
    assert all(s.num_cached_prompt_tokens <= s.num_prompt_tokens for s in seqs)
