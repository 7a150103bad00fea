"""Routing: prefix affinity and least-loaded, in the Router and through a real scheduler."""

from gpu_worker_svc.engine.block_pool import BlockPool
from scheduler_svc.live_request import LiveRequest
from scheduler_svc.router import Router, prefix_hashes
from scheduler_svc.worker_registry import WorkerRegistry
from shardline.proto import sampling_pb2, worker_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.tracing.run_async import run_async


def test_prefix_hashes_are_the_engine_block_hashes() -> None:
    prompt = list(range(100, 111))  # two full blocks of 4 and a partial one
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    parent = None
    for block_id, start in zip(blocks, (0, 4)):
        parent = pool.cache_full_block(block_id, parent, prompt[start : start + 4])
    assert prefix_hashes(prompt, 4, max_blocks=8) == [pool.block_hash(b) for b in blocks]
    assert prefix_hashes(prompt, 4, max_blocks=1) == [pool.block_hash(blocks[0])]
    assert prefix_hashes(prompt[:3], 4, max_blocks=8) == []


def _request(request_id: str, prompt: list[int]) -> LiveRequest:
    return LiveRequest(
        request_id=request_id,
        gateway_id="gw",
        model="m",
        priority=0,
        prompt_token_ids=prompt,
        params=sampling_pb2.SamplingParameters(),
        eos_token_ids=[],
        arrival_ts=0.0,
    )


def _pool(*worker_ids: str) -> WorkerRegistry:
    registry = WorkerRegistry(overcommit=1.0, heartbeat_timeout_s=10)
    for worker_id in worker_ids:
        registry.add(worker_pb2.WorkerInfo(worker_id=worker_id, model="m", block_size=4, max_num_seqs=8))
    return registry


def _route(router: Router, registry: WorkerRegistry, request: LiveRequest) -> str:
    worker = router.choose(request, registry.with_room(request.model))
    worker.in_flight.add(request.request_id)
    return worker.worker_id


def test_same_prefix_sticks_to_one_worker_until_it_is_much_busier() -> None:
    registry, router = _pool("w0", "w1", "w2"), Router(load_slack=0.25)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    # Same first two blocks, different tails: all share the cached prefix.
    chosen = [_route(router, registry, _request(f"r{i}", shared + [i])) for i in range(4)]
    assert len(set(chosen[:3])) == 1
    # Three in flight (3/8) against idle workers is more than the slack: balance wins.
    assert chosen[3] != chosen[0]


def test_longest_remembered_prefix_wins() -> None:
    registry, router = _pool("w0", "w1"), Router(load_slack=0.25)
    system, turn = [1, 2, 3, 4], [5, 6, 7, 8]
    first = _route(router, registry, _request("a", system + turn))
    second = "w1" if first == "w0" else "w0"
    # While the first worker is busy, another chat with the same system block goes to the second one.
    busy = {f"busy{i}" for i in range(3)}
    registry.get(first).in_flight.update(busy)
    assert _route(router, registry, _request("b", system + [9, 9, 9, 9])) == second
    registry.get(first).in_flight.difference_update(busy)
    # The system block was last served by the second worker, but the first one holds the whole first turn.
    assert _route(router, registry, _request("a-follow-up", system + turn + [1])) == first
    # Which made the first worker the last to serve the system block too.
    assert _route(router, registry, _request("c", system + [3, 3, 3, 3])) == first


def test_short_prompts_go_to_the_least_loaded_worker() -> None:
    registry, router = _pool("w0", "w1"), Router(load_slack=0.25)
    for i in range(3):
        registry.get("w0").in_flight.add(f"busy{i}")
    assert [_route(router, registry, _request(f"r{i}", [1, 2])) for i in range(3)] == ["w1", "w1", "w1"]
    assert len(registry.get("w1").in_flight) == 3


@run_async
async def test_prefix_affinity_through_the_scheduler(redis_url: str) -> None:
    async with cluster(redis_url, affinity_load_slack=0.5) as c:
        await c.gateway("gw-1")
        w0 = await c.worker("w0", max_num_seqs=8, block_size=4)
        w1 = await c.worker("w1", max_num_seqs=8, block_size=4)
        for worker in (w0, w1):
            worker.generating.clear()  # keep everything in flight
        prefix = [11, 12, 13, 14, 15, 16, 17, 18]
        for i in range(3):
            await c.submit(f"p{i}", prompt=prefix + [i], max_tokens=4)
            await eventually(lambda: len(w0.received) + len(w1.received) == i + 1, what=f"p{i} dispatched")
        holder = w0 if w0.received else w1
        assert [r.request_id for r in holder.received] == ["p0", "p1", "p2"]


@run_async
async def test_least_loaded_through_the_scheduler(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        busy = await c.worker("w0", max_num_seqs=4)
        busy.generating.clear()
        for i in range(3):
            await c.submit(f"old{i}", prompt=[i], max_tokens=2)
        await eventually(lambda: len(busy.received) == 3, what="three requests on w0")
        idle = await c.worker("w1", max_num_seqs=4)
        for i in range(3):
            await c.submit(f"new{i}", prompt=[i], max_tokens=2)
        await gateway.wait_finished("new0", "new1", "new2")
        assert [r.request_id for r in idle.received] == ["new0", "new1", "new2"]
