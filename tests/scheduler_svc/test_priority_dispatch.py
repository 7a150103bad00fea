"""A worker full of a worse class still takes a better one, within bounded headroom, so that its
engine can preempt: through the registry and through a real scheduler with a scripted worker."""

from scheduler_svc.worker_registry import WorkerRegistry
from shardline.proto import worker_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.scheduler_svc.scripted_worker import token_at
from tests.tracing.run_async import run_async

LOW, HIGH = 5, 0


def _worker(max_num_seqs: int = 4):
    registry = WorkerRegistry(overcommit=1.5, heartbeat_timeout_s=10)
    worker = registry.add(worker_pb2.WorkerInfo(worker_id="w0", model="m", max_num_seqs=max_num_seqs))
    return registry, worker


def test_a_full_worker_takes_only_a_better_class_than_the_worst_it_holds() -> None:
    registry, worker = _worker()
    for i in range(worker.capacity):
        worker.hold(f"low{i}", LOW)
    worker.hold("mid", 3)
    worker.release("low0", LOW)  # back to capacity, one of them class 3
    assert not registry.has_room() and not worker.has_room
    assert not registry.has_room(LOW) and not registry.has_room(LOW + 1) and registry.has_room(3)
    assert registry.with_room("m", LOW) == [] and registry.with_room("m", HIGH) == [worker]
    assert registry.with_room("m") == []  # without a class, only free places count
    while worker.has_room_for(HIGH):
        worker.hold(f"high{len(worker.in_flight)}", HIGH)
    assert len(worker.in_flight) == worker.capacity + 4  # headroom: one more batch, max_num_seqs
    assert worker.classes == {LOW: worker.capacity - 1, 3: 1, HIGH: 4}


def test_released_classes_leave_the_count_and_a_draining_worker_takes_nothing() -> None:
    registry, worker = _worker(max_num_seqs=2)
    for i in range(worker.capacity):
        worker.hold(f"low{i}", LOW)
    assert worker.has_room_for(HIGH)
    for i in range(worker.capacity):
        worker.release(f"low{i}", LOW)
    worker.release("never-held", LOW)
    assert worker.classes == {} and worker.in_flight == set()
    worker.in_flight.update({"a", "b", "c"})  # requests counted without a class take no headroom
    assert not worker.has_room_for(HIGH)
    worker.in_flight.clear()
    worker.draining = True
    assert not worker.has_room_for(HIGH) and registry.with_room("m", HIGH) == []


@run_async
async def test_a_better_class_reaches_a_worker_full_of_a_worse_one_at_once(redis_url: str) -> None:
    async with cluster(redis_url, dispatch_overcommit=1.5) as c:
        gateway = await c.gateway("gw-1")
        worker = await c.worker("w0", max_num_seqs=4)
        worker.generating.clear()  # nothing finishes: a free place could only come from the headroom
        capacity = 6  # 4 x 1.5
        for i in range(capacity + 1):
            await c.submit(f"low{i}", max_tokens=3, seed=i, priority=LOW)
        await eventually(lambda: len(worker.received) == capacity, what="the worker to fill with low-class requests")
        for i in range(5):
            await c.submit(f"high{i}", max_tokens=3, seed=100 + i, priority=HIGH)

        def received() -> set[str]:
            return {r.request_id for r in worker.received}

        await eventually(lambda: {f"high{i}" for i in range(4)} <= received(), what="the high-class requests")
        assert not any(gateway.deltas(f"low{i}") for i in range(capacity))  # no low one finished first
        # Bounded: max_num_seqs more than capacity, and only for the better class.
        assert len(worker.received) == capacity + 4
        assert "high4" not in received() and f"low{capacity}" not in received()
        assert [r.priority for r in worker.received[capacity:]] == [HIGH] * 4
        worker.generating.set()
        await gateway.wait_finished(*(f"high{i}" for i in range(5)), *(f"low{i}" for i in range(capacity + 1)))
        assert gateway.tokens("high4") == [token_at(104, i) for i in range(3)]
