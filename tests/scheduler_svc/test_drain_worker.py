"""A worker stopping on SIGTERM leaves the pool through `Scheduler.DrainWorker`, with scripted workers:
its requests move with their tokens, each one's KV blocks sent ahead to the worker it moves to, within
the call's deadline; past it, or when a send fails, they move anyway and re-prefill."""

import asyncio

import grpc
import pytest

from shardline.proto import sampling_pb2, scheduler_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.scheduler_svc.scripted_worker import token_at
from tests.tracing.run_async import run_async


async def _requests_on(c, gateway, count: int, max_tokens: int = 150) -> dict[str, str]:
    """Workers w0 and w1, `count` requests r0.. (seed = index) streaming: where each one runs."""
    for worker_id in ("w0", "w1"):
        await c.worker(worker_id, max_num_seqs=4, tick_s=0.02)
    ids = [f"r{i}" for i in range(count)]
    for i, request_id in enumerate(ids):
        await c.submit(request_id, max_tokens=max_tokens, seed=i, prompt=[5 + i, 6])
    await eventually(lambda: all(len(gateway.tokens(r)) > 5 for r in ids), what="tokens")
    return {rid: (await c.info(rid)).worker_id for rid in ids}


def _worker(c, worker_id: str):
    return next(w for w in c.workers if w.info.worker_id == worker_id)


async def _drain(c, worker_id: str, timeout_s: float) -> scheduler_pb2.DrainWorkerResponse:
    # As the real worker does before it asks: no heartbeat may register it again.
    _worker(c, worker_id).stop_heartbeats()
    return await c.stub.DrainWorker(scheduler_pb2.DrainWorkerRequest(worker_id=worker_id), timeout=timeout_s)


async def _all_tokens_as_unmoved(c, gateway, placed: dict[str, str], gone: str, max_tokens: int = 150) -> None:
    await gateway.wait_finished(*placed, timeout_s=20)
    for i, request_id in enumerate(placed):
        assert gateway.tokens(request_id) == [token_at(i, k) for k in range(max_tokens)]
        assert gateway.final(request_id).finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        info = await c.info(request_id)
        assert info.worker_id != gone and info.attempt == 1, info  # moved, not failed


@run_async
async def test_a_stopping_worker_hands_its_requests_kv_to_where_they_move(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        placed = await _requests_on(c, gateway, 2)
        assert set(placed.values()) == {"w0", "w1"}, placed  # the router spread them
        gone = placed["r0"]
        reply = await _drain(c, gone, timeout_s=5)
        assert (reply.moved, reply.handed_off) == (1, 1)
        listed = await c.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        assert gone not in {w.worker.worker_id for w in listed.workers}
        await _all_tokens_as_unmoved(c, gateway, placed, gone)
        # Its blocks went to the worker the request then ran on.
        [send] = _worker(c, gone).kv.sends
        stayed = (await c.info("r0")).worker_id
        assert (send.request_id, send.target_address) == ("r0", _worker(c, stayed).info.address)


@run_async
async def test_past_its_deadline_the_hand_off_stops_and_the_rest_move_without_their_kv(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        placed = await _requests_on(c, gateway, 4)
        gone = max(set(placed.values()), key=lambda w: list(placed.values()).count(w))
        on_it = sum(1 for w in placed.values() if w == gone)
        assert on_it >= 2, placed
        # Each send takes 2 s: the first outlasts the hand-off's second and the rest are not tried.
        _worker(c, gone).kv.delay_s = 2.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await _drain(c, gone, timeout_s=1.5)
        # The answer comes before the caller's deadline, the margin kept for the move itself.
        assert loop.time() - started < 1.5
        assert (reply.moved, reply.handed_off) == (on_it, 0)
        assert len(_worker(c, gone).kv.sends) == 1
        await _all_tokens_as_unmoved(c, gateway, placed, gone)


@run_async
async def test_a_failed_hand_off_still_moves_the_requests_with_their_tokens(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        placed = await _requests_on(c, gateway, 2)
        gone = placed["r1"]
        _worker(c, gone).kv.refuse = True
        reply = await _drain(c, gone, timeout_s=5)
        assert (reply.moved, reply.handed_off) == (1, 0)
        await _all_tokens_as_unmoved(c, gateway, placed, gone)


@run_async
async def test_a_worker_not_in_the_pool_is_answered_not_found(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.stub.DrainWorker(scheduler_pb2.DrainWorkerRequest(worker_id="nobody"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "worker_id" in refused.value.details()
