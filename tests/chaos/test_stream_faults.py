"""Every service of a real stack, Redis included, SIGKILLed (or cut off) under 32 concurrent greedy
streams: each stream ends identical to a run with no fault, directly or through the SDK's resume;
none is silently short or wrong."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis

from shardline.client import ShardlineClient
from shardline.stack.health_probe import grpc_serving
from shardline.stack.local_stack import LocalStack, StackConfig
from tests.chaos.streams import MAX_TOKENS, StreamResult, prompts, run_streams, summary
from tests.e2e.conftest import log_dir, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

log = logging.getLogger(__name__)
STREAMS = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> LocalStack:
    # A 2 s outage bound, so that Redis down for 5 s fails streams resumably instead of pausing them.
    config = StackConfig.on_free_ports(
        workers=2,
        data_dir=tmp_path_factory.mktemp("chaos-data"),
        log_dir=log_dir(tmp_path_factory, "chaos"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(64 << 20), "REDIS_OUTAGE_S": "2"},
    )
    with running_stack(config) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack: LocalStack) -> dict[int, list[int]]:
    """Each prompt's tokens in a run with no fault."""
    results = asyncio.run(run_streams(_target(stack), [f"reference-{i}" for i in range(STREAMS)], prompts(STREAMS)))
    assert all(r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS for r in results), results
    return {i: r.tokens for i, r in enumerate(results)}


def _target(stack: LocalStack) -> str:
    return f"127.0.0.1:{stack.config.grpc_port}"


@contextlib.asynccontextmanager
async def supervised(stack: LocalStack) -> AsyncIterator[list[bool]]:
    """What `shardline up` does meanwhile: restart whatever exits (set [0] to False to pause it)."""
    supervisor = stack.supervisor(report=log.warning)
    running = [True]

    async def loop() -> None:
        while True:
            if running[0]:
                supervisor.check()
            await asyncio.sleep(0.1)

    task = asyncio.create_task(loop())
    try:
        yield running
    finally:
        task.cancel()


def wait_healthy(stack: LocalStack, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{stack.config.http_port}/health"
    while True:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        assert time.monotonic() < deadline, "the stack did not come back healthy"
        time.sleep(0.25)


def outage_is_reported(stack: LocalStack) -> None:
    """While Redis is down: /health 503, both gRPC healths NOT_SERVING, and a new request 503 with
    Retry-After, not a 500 or a hang."""
    gateway, scheduler = f"127.0.0.1:{stack.config.grpc_port}", f"127.0.0.1:{stack.config.scheduler_port}"
    deadline = time.monotonic() + 4.0
    while grpc_serving(gateway) or grpc_serving(scheduler) or _http_status(stack, "/health") != 503:
        assert time.monotonic() < deadline, "the outage was not reported"
        time.sleep(0.1)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.config.http_port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"]


def _http_status(stack: LocalStack, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.config.http_port}{path}", timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def under_fault(
    stack: LocalStack,
    reference: dict[int, list[int]],
    name: str,
    fault: Callable[[list[bool]], Awaitable[None]],
    resumed: bool = False,
) -> list[StreamResult]:
    """Streams every prompt, runs `fault` once each stream has a few tokens, and checks every result:
    with `resumed`, each stream failed resumably and came back through a resume; without, none saw
    an error at all."""
    wait_healthy(stack)

    async def body() -> list:
        started = asyncio.Event()
        async with supervised(stack) as supervising:
            streams = asyncio.create_task(
                run_streams(
                    _target(stack),
                    [f"{name}-{i}" for i in range(STREAMS)],
                    prompts(STREAMS),
                    started=started,
                    started_after_tokens=4,
                )
            )
            await asyncio.wait_for(started.wait(), 120)
            await fault(supervising)
            results = await streams
            # Let the supervisor finish what it restarts, so the next scenario starts whole.
            await asyncio.to_thread(wait_healthy, stack)
        return results

    results = asyncio.run(body())
    print(f"\n{name}: {summary(results, reference)}")
    for i, result in enumerate(results):
        assert result.gaps == 0, (name, result)
        assert result.finish_reason == "length", (name, result)
        assert result.tokens == reference[i], (name, result)
        assert result.resumes > 0 if resumed else not result.errors, (name, result)
    return results


def test_a_worker_killed(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        stack.kill("worker-0")

    results = under_fault(stack, reference, "worker", fault)
    with ShardlineClient(_target(stack)) as client:
        attempts = [client.get_request(r.request_id).attempt for r in results]
    assert 2 in attempts, attempts  # the requests worker-0 held ran again elsewhere


def test_the_scheduler_killed(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        stack.kill("scheduler")

    under_fault(stack, reference, "scheduler", fault)


def test_the_tokenizer_killed(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        stack.kill("tokenizer")

    under_fault(stack, reference, "tokenizer", fault)


def test_the_gateway_killed_and_the_streams_resumed(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        stack.kill("gateway")

    under_fault(stack, reference, "gateway", fault, resumed=True)


def test_redis_killed_and_restarted_by_the_supervisor(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        os.kill(stack.redis.pid, signal.SIGKILL)

    under_fault(stack, reference, "redis-supervised", fault)


def test_redis_killed_and_restarted_by_hand_on_its_aof_after_5_s(stack, reference) -> None:
    async def fault(supervising: list[bool]) -> None:
        supervising[0] = False
        os.kill(stack.redis.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        await asyncio.to_thread(outage_is_reported, stack)
        await asyncio.sleep(max(0.0, 5.0 - (time.monotonic() - t_kill)))  # past the 2 s bound: streams fail
        stack.redis.respawn()
        supervising[0] = True

    under_fault(stack, reference, "redis-by-hand", fault, resumed=True)


def test_redis_connections_killed_three_times(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        admin = redis.Redis.from_url(stack.redis_url)
        for _ in range(3):
            admin.client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.4)
        admin.close()

    under_fault(stack, reference, "client-kill", fault)


def test_redis_writes_paused_for_3_s(stack, reference) -> None:
    async def fault(_: list[bool]) -> None:
        admin = redis.Redis.from_url(stack.redis_url)
        admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
        admin.close()

    under_fault(stack, reference, "client-pause", fault)
