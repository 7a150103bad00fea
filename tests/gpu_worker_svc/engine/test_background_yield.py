"""Background sequences (batch jobs) yield to the foreground: while a foreground sequence runs or
waits, at most background_max_seqs background ones run; alone, they use the whole batch."""

from __future__ import annotations

from tests.gpu_worker_svc.engine.test_batch_scheduler import run_to_end, step

BATCH = 100  # the batch workers' priority class


def _running(sched) -> tuple[int, int]:
    """(foreground, background) sequences running."""
    background = sum(1 for s in sched.running if s.priority >= BATCH)
    return len(sched.running) - background, background


def test_alone_background_work_fills_the_batch(create_scheduler, create_requests):
    sched = create_scheduler(background_priority=BATCH, background_max_seqs=2)
    for seq in create_requests(6, num_tokens=4, priorities=[BATCH] * 6):
        sched.add(seq)
    step(sched)
    assert _running(sched) == (0, 6)


def test_a_foreground_arrival_sends_the_newest_background_ones_back(create_scheduler, create_requests):
    sched = create_scheduler(background_priority=BATCH, background_max_seqs=2)
    background = create_requests(6, num_tokens=4, priorities=[BATCH] * 6, arrival_times=[float(i) for i in range(6)])
    for seq in background:
        sched.add(seq)
    step(sched)
    step(sched)  # two decodes: each has output a yield must keep
    (interactive,) = create_requests(1, num_tokens=4, prefix="chat", arrival_times=[10.0])
    sched.add(interactive)
    out, _ = step(sched)
    assert sorted(out.preempted_ids) == ["req2", "req3", "req4", "req5"]  # the newest four
    assert "chat0" in [s.seq.request_id for s in out.scheduled]  # admitted in the same step
    assert _running(sched) == (1, 2)
    for _ in range(3):  # while it runs, no more background work comes in
        step(sched)
        assert _running(sched)[1] <= 2
    finished = run_to_end(sched)
    assert {s.request_id for s in finished} == {f"req{i}" for i in range(6)} | {"chat0"}
    # Sent back and taken up again, each background sequence has every token of its own: none lost.
    assert all(s.output_token_ids == [500 + i for i in range(8)] for s in finished)


def test_a_yielded_sequence_recomputes_from_the_prefix_cache(create_scheduler, create_requests):
    sched = create_scheduler(background_priority=BATCH, background_max_seqs=0, num_blocks=64)
    (batch,) = create_requests(1, num_tokens=12, max_tokens=20, priorities=[BATCH])
    sched.add(batch)
    for _ in range(6):
        step(sched)
    computed = batch.num_computed_tokens
    (chat,) = create_requests(1, num_tokens=4, max_tokens=2, prefix="chat")
    sched.add(chat)
    out, _ = step(sched)
    assert out.preempted_ids == ["req0"] and _running(sched) == (1, 0)
    run_to_end_of = [step(sched) for _ in range(2)]
    assert run_to_end_of and not sched.get("chat0")  # the foreground request is done
    out, _ = step(sched)  # the background one comes back, its full blocks served by the cache
    (item,) = out.scheduled
    assert item.seq is batch and batch.num_cached_tokens >= (computed // 4) * 4 - 4


def test_without_a_background_class_nothing_yields(create_scheduler, create_requests):
    sched = create_scheduler()
    for seq in create_requests(6, num_tokens=4, priorities=[BATCH] * 6):
        sched.add(seq)
    step(sched)
    (chat,) = create_requests(1, num_tokens=4, prefix="chat")
    sched.add(chat)
    out, _ = step(sched)
    assert out.preempted_ids == [] and len(sched.running) == 7


def test_the_cap_holds_for_the_grace_after_the_last_foreground_left(create_scheduler, create_requests):
    """A client's next request is on its way: the batch does not fill the gap in between."""
    now = [0.0]
    sched = create_scheduler(
        background_priority=BATCH, background_max_seqs=1, background_grace_s=2.0, clock=lambda: now[0]
    )
    (chat,) = create_requests(1, num_tokens=4, max_tokens=1, prefix="chat")
    sched.add(chat)
    for seq in create_requests(4, num_tokens=4, max_tokens=50, priorities=[BATCH] * 4):
        sched.add(seq)
    step(sched)  # the chat request's one token: it finishes
    assert sched.get("chat0") is None
    now[0] = 1.5
    step(sched)
    assert _running(sched) == (0, 1)  # within the grace: still one
    now[0] = 2.5
    step(sched)
    assert _running(sched) == (0, 4)  # past it: the batch takes the whole batch again
