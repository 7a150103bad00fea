"""A Redis that dies, drops its connections or pauses its writes, under streaming requests: no token
is lost, doubled or relayed before it is recorded, and a long outage fails streams resumably."""

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.core.errors import STREAM_INTERRUPTED
from shardline.proto import common_pb2, sampling_pb2
from shardline.stack.redis_server import EmbeddedRedis
from tests.scheduler_svc.harness import Cluster, Gateway, cluster, eventually
from tests.scheduler_svc.scripted_worker import token_at
from tests.tracing.run_async import run_async

IDS = [f"r{i}" for i in range(8)]
MAX_TOKENS = 60


@pytest.fixture
def own_redis(tmp_path: Path) -> EmbeddedRedis:
    """A redis-server of this test's own, since the test kills it."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server


@asynccontextmanager
async def streaming(own_redis: EmbeddedRedis, **settings: object) -> AsyncIterator[tuple[Cluster, Gateway]]:
    """A scheduler and a worker with 8 requests streaming, 60 tokens each, a token every 20 ms."""
    async with cluster(own_redis.url, **settings) as c:
        gateway = await c.gateway("gw-1")
        await c.worker("w0", max_num_seqs=8, tick_s=0.02, reregister=True)
        for i, request_id in enumerate(IDS):
            await c.submit(request_id, max_tokens=MAX_TOKENS, seed=i)
        await eventually(lambda: all(len(gateway.tokens(r)) >= 5 for r in IDS), what="the streams to start")
        yield c, gateway


def expected(request_id: str) -> list[int]:
    seed = IDS.index(request_id)
    return [token_at(seed, i) for i in range(MAX_TOKENS)]


async def assert_identical(c: Cluster, gateway: Gateway) -> None:
    """Every stream and every record is the unbroken run's: contiguous, no token missing or twice."""
    await gateway.wait_finished(*IDS, timeout_s=30)
    for request_id in IDS:
        deltas = [d for d in gateway.deltas(request_id) if d.token_ids]
        assert [d.offset for d in deltas] == list(range(MAX_TOKENS)), request_id
        assert gateway.tokens(request_id) == expected(request_id)
        final = gateway.final(request_id)
        assert final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == MAX_TOKENS
        info = await c.info(request_id)
        assert info.status == sampling_pb2.REQUEST_STATUS_FINISHED
        assert list(info.output_token_ids) == expected(request_id)


async def scheduler_health(c: Cluster, becomes: int | None = None) -> int:
    """The scheduler's gRPC health; with `becomes`, once it says so (within 5 s)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{c.server.port}") as channel:
        for _ in range(100):
            status = (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status
            if becomes is None or status == becomes:
                break
            await asyncio.sleep(0.05)
        return status


async def finished(c: Cluster, request_id: str, timeout_s: float = 30.0) -> common_pb2.RequestInfo:
    """The request's record once it is finished (reads fail while Redis is still coming back)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            info = await c.info(request_id)
            if info.status >= sampling_pb2.REQUEST_STATUS_FINISHED:
                return info
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} not finished after {timeout_s}s")


@run_async
async def test_a_redis_killed_and_restarted_on_its_aof_pauses_the_streams_and_loses_nothing(
    own_redis: EmbeddedRedis,
) -> None:
    async with streaming(own_redis) as (c, gateway):
        os.kill(own_redis.pid, signal.SIGKILL)
        await asyncio.sleep(1.0)
        held = {r: len(gateway.tokens(r)) for r in IDS}
        await asyncio.sleep(0.3)
        # Nothing is relayed that Redis has not recorded: the streams pause.
        assert {r: len(gateway.tokens(r)) for r in IDS} == held
        assert await scheduler_health(c) == health_pb2.HealthCheckResponse.NOT_SERVING
        own_redis.respawn()
        await assert_identical(c, gateway)
        SERVING = health_pb2.HealthCheckResponse.SERVING
        assert await scheduler_health(c, becomes=SERVING) == SERVING


@run_async
async def test_connections_killed_three_times_under_load_lose_no_token(own_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    async with streaming(own_redis) as (c, gateway):
        for _ in range(3):
            assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
            await asyncio.sleep(0.4)
        await assert_identical(c, gateway)
    admin.close()


@run_async
async def test_writes_paused_for_3_s_lose_no_token(own_redis: EmbeddedRedis) -> None:
    admin = redis.Redis.from_url(own_redis.url)
    async with streaming(own_redis) as (c, gateway):
        admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
        await assert_identical(c, gateway)
    admin.close()


@run_async
async def test_a_long_outage_fails_the_streams_resumably_and_the_requests_finish_after_it(
    own_redis: EmbeddedRedis,
) -> None:
    async with streaming(own_redis, redis_outage_s=0.5) as (c, gateway):
        os.kill(own_redis.pid, signal.SIGKILL)
        await gateway.wait_finished(*IDS, timeout_s=10)
        offsets = {}
        for request_id in IDS:
            final = gateway.final(request_id)
            # Ended at what was recorded (every token relayed before it), not silently short.
            assert final.finish_reason == sampling_pb2.FINISH_REASON_ERROR
            assert final.error.startswith(STREAM_INTERRUPTED) and "resume it at offset" in final.error
            assert final.offset == len(gateway.tokens(request_id)) > 0
            assert gateway.tokens(request_id) == expected(request_id)[: final.offset]
            offsets[request_id] = final.offset
        # Meanwhile new requests and reads answer UNAVAILABLE, not INTERNAL.
        for call in (c.submit("late"), c.info("r0")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await scheduler_health(c) == health_pb2.HealthCheckResponse.NOT_SERVING

        own_redis.respawn()
        # The requests run on from what Redis holds, on the worker that registered again.
        for request_id in IDS:
            info = await finished(c, request_id)
            assert info.status == sampling_pb2.REQUEST_STATUS_FINISHED and info.attempt == 1
            assert list(info.output_token_ids) == expected(request_id)
        SERVING = health_pb2.HealthCheckResponse.SERVING
        assert await scheduler_health(c, becomes=SERVING) == SERVING
