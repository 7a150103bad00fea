"""With no live worker of its model for no_worker_timeout_s, a request fails with UNAVAILABLE and says
why, rather than waiting out its deadline; a worker that registers ends that."""

import asyncio
import time

import grpc
import pytest

from shardline.core.errors import NO_WORKER
from shardline.proto import sampling_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.tracing.run_async import run_async


@run_async
async def test_the_requests_of_a_dead_workers_model_fail_once_none_is_back(redis_url: str) -> None:
    async with cluster(redis_url, no_worker_timeout_s=1.5) as c:
        gateway = await c.gateway("gw-1")
        worker = await c.worker("w0")
        await c.submit("running", max_tokens=1000)
        await eventually(lambda: worker.running, what="the request on w0")
        await worker.kill()
        await c.submit("queued", max_tokens=5)  # after the death: it waits for a worker
        lost = time.monotonic()
        await gateway.wait_finished("running", "queued", timeout_s=10)
        waited = time.monotonic() - lost
        assert 1.0 < waited < 5.0, waited  # the timeout, plus a sweep, not the request's deadline
        for request_id in ("running", "queued"):
            final = gateway.final(request_id)
            assert final.finish_reason == sampling_pb2.FINISH_REASON_ERROR
            assert final.error.startswith(NO_WORKER) and "'test-model'" in final.error, final.error
            info = await c.info(request_id)
            assert info.status == sampling_pb2.REQUEST_STATUS_FAILED
        # Still none: a new request is refused at once, saying why.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.submit("late")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details().startswith(NO_WORKER)
        # A worker of the model registers: requests are taken again.
        back = await c.worker("w1")
        await c.submit("after", max_tokens=3)
        await gateway.wait_finished("after")
        assert gateway.final("after").finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert [r.request_id for r in back.received] == ["after"]


@run_async
async def test_requests_wait_for_a_worker_within_the_timeout(redis_url: str) -> None:
    """A scheduler that has just started, or a worker that restarts quickly: the requests wait."""
    async with cluster(redis_url, no_worker_timeout_s=30) as c:
        gateway = await c.gateway("gw-1")
        await c.submit("early", max_tokens=3)
        await asyncio.sleep(1.5)
        assert gateway.final("early") is None
        await c.worker("w0")
        await gateway.wait_finished("early")
        assert gateway.final("early").finish_reason == sampling_pb2.FINISH_REASON_LENGTH


@run_async
async def test_an_autoscaler_that_may_start_a_worker_adds_its_cold_start(redis_url: str) -> None:
    async with cluster(
        redis_url,
        no_worker_timeout_s=1,
        autoscale_policy="reactive",
        autoscale_min_workers=0,
        autoscale_cold_start_s=20,
    ) as c:
        assert c.server.dispatcher.coverage.timeout_s == 21


@run_async
async def test_the_timeout_counts_from_when_the_last_worker_left(redis_url: str) -> None:
    """A worker that served for longer than the timeout, with nothing queued meanwhile, then left: a
    request arriving at once still waits for a worker, rather than being refused."""
    async with cluster(redis_url, no_worker_timeout_s=1.5) as c:
        gateway = await c.gateway("gw-1")
        worker = await c.worker("w0")
        await asyncio.sleep(2.5)
        await worker.kill()
        await eventually(lambda: not c.server.dispatcher.registry.get("w0"), what="w0 to be gone")
        await c.submit("right-after", max_tokens=3)
        await asyncio.sleep(0.5)
        assert gateway.final("right-after") is None
        await gateway.wait_finished("right-after", timeout_s=10)
        assert gateway.final("right-after").error.startswith(NO_WORKER)
