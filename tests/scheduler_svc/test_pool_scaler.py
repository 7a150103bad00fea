"""The autoscaler in a real scheduler, with scripted workers: it asks for workers under load, counts
the ones that register against its asks, drains on the way down, moves what a drain outlasts, and
retires the drained workers through their heartbeats."""

import asyncio

from shardline.proto import sampling_pb2, scheduler_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.scheduler_svc.scripted_worker import token_at
from tests.tracing.run_async import run_async

SCALING = dict(
    autoscale_policy="reactive",
    autoscale_min_workers=1,
    autoscale_interval_s=0.1,
    autoscale_scale_down_window_s=0.5,
    # Scaling down waits a cold start too (a worker shed then needed pays it again): these are short.
    autoscale_cold_start_s=0.5,
)


async def _scale(c) -> scheduler_pb2.ModelScale | None:
    stats = await c.stub.GetStats(scheduler_pb2.GetStatsRequest())
    return stats.scale[0] if stats.scale else None


async def _until(c, predicate, what: str, timeout_s: float = 15.0) -> scheduler_pb2.ModelScale:
    latest: list[scheduler_pb2.ModelScale | None] = [None]

    async def check() -> bool:
        latest[0] = await _scale(c)
        return latest[0] is not None and predicate(latest[0])

    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"no {what}: {latest[0]}"
        await asyncio.sleep(0.05)
    return latest[0]


def _worker(c, worker_id: str):
    return next(w for w in c.workers if w.info.worker_id == worker_id)


async def _two_requests_on_two_workers(c, gateway, max_tokens: int) -> dict[str, str]:
    """Workers w0 and w1, requests "a" (seed 3) and "b" (seed 4) streaming: where each one runs."""
    for worker_id in ("w0", "w1"):
        await c.worker(worker_id, max_num_seqs=4, tick_s=0.02)
    await c.submit("a", max_tokens=max_tokens, seed=3, prompt=[5, 6])
    await c.submit("b", max_tokens=max_tokens, seed=4, prompt=[7, 8])
    await eventually(lambda: len(gateway.tokens("a")) > 5 and len(gateway.tokens("b")) > 5, what="tokens")
    return {rid: (await c.info(rid)).worker_id for rid in ("a", "b")}


@run_async
async def test_load_asks_for_workers_and_its_end_drains_and_retires_them(redis_url: str) -> None:
    async with cluster(redis_url, autoscale_max_workers=3, **SCALING) as c:
        gateway = await c.gateway("gw-1")
        await c.worker("w0", max_num_seqs=2, tick_s=0.02)
        ids = [f"r{i}" for i in range(8)]
        for i, request_id in enumerate(ids):
            await c.submit(request_id, max_tokens=40, seed=i, prompt=[10 + i, 1])
        scale = await _until(c, lambda s: s.desired == 3 and s.starting == 2, "ask for two more workers")
        assert scale.policy == "reactive" and scale.ready == 1 and scale.reason
        workers = [await c.worker(f"w{i}", max_num_seqs=2, tick_s=0.02) for i in (1, 2)]
        scale = await _until(c, lambda s: s.ready == 3 and s.starting == 0, "the asks met by registrations")
        assert 0 < scale.cold_start_s < 15  # measured: asked to registered
        await gateway.wait_finished(*ids, timeout_s=20)

        # Idle: down to the minimum, every removed worker drained first, then retired.
        scale = await _until(c, lambda s: s.desired == 1 and s.ready == 1 and not s.draining, "drain to one")
        retired = set(scale.retired)
        assert len(retired) == 2
        everyone = {"w0": c.workers[0], **{w.info.worker_id: w for w in workers}}
        for worker_id in retired:
            await asyncio.wait_for(everyone[worker_id].retired.wait(), 5)  # told through its heartbeat
        listed = await c.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        assert {w.worker.worker_id for w in listed.workers} == set(everyone) - retired
        for i, request_id in enumerate(ids):
            assert gateway.tokens(request_id) == [token_at(i, k) for k in range(40)]
            assert (await c.info(request_id)).attempt == 1


@run_async
async def test_a_drain_past_its_timeout_moves_the_requests_with_their_tokens(redis_url: str) -> None:
    async with cluster(redis_url, autoscale_max_workers=2, autoscale_drain_timeout_s=0.3, **SCALING) as c:
        gateway = await c.gateway("gw-1")
        # Two requests on eight slots: one worker is enough, and the one drained holds a request.
        placed = await _two_requests_on_two_workers(c, gateway, max_tokens=150)
        assert set(placed.values()) == {"w0", "w1"}, placed  # the router spread them
        scale = await _until(c, lambda s: len(s.retired) == 1, "a worker retired past its drain timeout")
        [gone] = scale.retired
        moved = next(rid for rid, worker_id in placed.items() if worker_id == gone)
        await gateway.wait_finished("a", "b", timeout_s=20)
        for request_id, seed in (("a", 3), ("b", 4)):
            assert gateway.tokens(request_id) == [token_at(seed, k) for k in range(150)]
            assert gateway.final(request_id).finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        info = await c.info(moved)
        assert info.worker_id != gone and info.attempt == 1  # moved, not failed
        # Before it moved, the drained worker was asked to send its KV blocks where it went.
        [send] = _worker(c, gone).kv.sends
        assert (send.request_id, send.target_address) == (moved, _worker(c, info.worker_id).info.address)


@run_async
async def test_a_kv_hand_off_that_fails_still_moves_the_requests_with_their_tokens(redis_url: str) -> None:
    async with cluster(redis_url, autoscale_max_workers=2, autoscale_drain_timeout_s=0.3, **SCALING) as c:
        gateway = await c.gateway("gw-1")
        placed = await _two_requests_on_two_workers(c, gateway, max_tokens=150)
        for worker in c.workers:
            worker.kv.refuse = True
        scale = await _until(c, lambda s: len(s.retired) == 1, "a worker retired past its drain timeout")
        [gone] = scale.retired
        moved = next(rid for rid, worker_id in placed.items() if worker_id == gone)
        await gateway.wait_finished("a", "b", timeout_s=20)
        for request_id, seed in (("a", 3), ("b", 4)):
            assert gateway.tokens(request_id) == [token_at(seed, k) for k in range(150)]
        assert [s.request_id for s in _worker(c, gone).kv.sends] == [moved]
        assert (await c.info(moved)).worker_id != gone


@run_async
async def test_a_drained_worker_is_retired_when_its_last_request_ends_not_at_the_next_round(redis_url: str) -> None:
    loop = asyncio.get_running_loop()
    settings = {**SCALING, "autoscale_interval_s": 1.5, "autoscale_scale_down_window_s": 0.0}
    async with cluster(redis_url, autoscale_max_workers=2, **settings) as c:
        gateway = await c.gateway("gw-1")
        placed = await _two_requests_on_two_workers(c, gateway, max_tokens=250)
        await _until(c, lambda s: s.draining == 1, "a drain with a request in flight")
        listed = await c.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        [drained] = [w.worker.worker_id for w in listed.workers if w.draining]
        its_own = next(rid for rid, worker_id in placed.items() if worker_id == drained)
        assert gateway.final(its_own) is None  # the drain began while its request ran
        await gateway.wait_finished(its_own, timeout_s=20)
        finished = loop.time()
        await _until(c, lambda s: drained in s.retired, "the drained worker retired")
        # Rounds are 1.5 s apart; the drain is checked every 0.2 s between them.
        assert loop.time() - finished < 0.5, loop.time() - finished
        await gateway.wait_finished("a", "b", timeout_s=20)
        assert gateway.tokens(its_own) == [token_at(3 if its_own == "a" else 4, k) for k in range(250)]
