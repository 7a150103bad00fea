"""Tenants' limits shared by two real gateway processes on one Redis: one limit for both, and the
concurrency slots of a gateway killed mid-request freed after their lease."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from gateway.tenancy.tenants import key_digest
from shardline.core.grpc_server import GrpcService, start_grpc_server
from shardline.core.ports import free_port
from shardline.proto import scheduler_pb2_grpc
from tests.gateway.conftest import REPO
from tests.gateway.harness import SCHEDULER_SERVICE
from tests.gateway.scripted_scheduler import Script, ScriptedScheduler

KEY = {"authorization": "Bearer k-acme"}
LEASE_S = 1.0


@asynccontextmanager
async def gateways(
    tokenizer_address: str, script: Script, tenants_file: Path, redis_url: str, count: int = 2
) -> AsyncIterator[tuple[ScriptedScheduler, list[tuple[subprocess.Popen, str]]]]:
    """`count` `python -m gateway.main` processes on one scripted scheduler and one Redis."""
    scheduler = ScriptedScheduler(script)
    service = GrpcService(scheduler, scheduler_pb2_grpc.add_SchedulerServicer_to_server, SCHEDULER_SERVICE)
    server = await start_grpc_server([service], 0, host="127.0.0.1")
    scheduler.start()
    started: list[tuple[subprocess.Popen, str]] = []
    try:
        for _ in range(count):
            port = free_port()
            env = {
                **os.environ,
                "SHARDLINE_HOST": "127.0.0.1",
                "SHARDLINE_HTTP_PORT": str(port),
                "SHARDLINE_GRPC_PORT": str(free_port()),
                "SHARDLINE_TOKENIZER_ADDRESS": tokenizer_address,
                "SHARDLINE_SCHEDULER_ADDRESS": f"127.0.0.1:{server.port}",
                "SHARDLINE_TENANTS_FILE": str(tenants_file),
                "SHARDLINE_REDIS_URL": redis_url,
                "SHARDLINE_RATE_LIMIT_LEASE_S": str(LEASE_S),
                "SHARDLINE_TRACING": "0",
            }
            process = subprocess.Popen(
                [sys.executable, "-m", "gateway.main"], cwd=REPO, env=env, stderr=subprocess.DEVNULL
            )
            started.append((process, f"http://127.0.0.1:{port}"))
        await asyncio.gather(*(_ready(process, url) for process, url in started))
        yield scheduler, started
    finally:
        for process, _ in started:
            if process.poll() is None:
                process.terminate()
        for process, _ in started:
            process.wait(timeout=10)
        await scheduler.stop()
        await server.stop(0)


async def _ready(process: subprocess.Popen, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            assert process.poll() is None, "the gateway exited"
            try:
                async with http.get(f"{url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"gateway at {url} did not become healthy")


async def status_of(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, str]]:
    body = {"prompt": [11, 12, 13], "max_tokens": 4}
    async with http.post(f"{url}/v1/completions", json=body, headers=KEY) as response:
        await response.read()
        return response.status, dict(response.headers)


def _tenants(tmp_path: Path, limits: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  acme:\n    keys: [{key_digest('k-acme')}]\n    limits: {limits}\n")
    return path


def test_two_gateway_processes_share_one_requests_per_minute_limit(
    tokenizer_address, text_ids, tmp_path: Path, redis_url: str
) -> None:
    async def body() -> None:
        path = _tenants(tmp_path, "{requests_per_minute: 4}")
        async with gateways(tokenizer_address, Script(text_ids[:2]), path, redis_url) as (scheduler, started):
            (_, a), (_, b) = started
            async with aiohttp.ClientSession() as http:
                # Four requests split across both gateways: each one alone would let four through.
                answers = [await status_of(http, url) for url in (a, b, a, b)]
                assert [status for status, _ in answers] == [200] * 4
                assert [h["x-ratelimit-remaining-requests"] for _, h in answers] == ["3", "2", "1", "0"]
                refused = [await status_of(http, url) for url in (a, b)]
                assert [status for status, _ in refused] == [429, 429]
                assert [h["Retry-After"] for _, h in refused] == ["15", "15"]  # 60 s / 4
            assert len(scheduler.submitted) == 4

    asyncio.run(body())


def test_a_killed_gateways_slots_are_freed_after_their_lease(
    tokenizer_address, text_ids, tmp_path: Path, redis_url: str
) -> None:
    async def body() -> None:
        path = _tenants(tmp_path, "{max_concurrent: 1}")
        script = Script(text_ids[:3], hold_after=1)  # requests run until released: they hold their slot
        async with gateways(tokenizer_address, script, path, redis_url) as (scheduler, started):
            (doomed, a), (_, b) = started
            async with aiohttp.ClientSession() as http:
                held = asyncio.create_task(status_of(http, a))
                while not scheduler.records:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(LEASE_S * 1.5)  # past one lease: gateway A renews it
                assert (await status_of(http, b))[0] == 429
                doomed.send_signal(signal.SIGKILL)  # mid-request: nothing gives its slot back
                killed_at = time.monotonic()
                scheduler.release()  # B's request, once admitted, runs to its end
                await asyncio.gather(held, return_exceptions=True)
                while (await status_of(http, b))[0] == 429:
                    assert time.monotonic() - killed_at < LEASE_S + 2, "the dead gateway's slot never expired"
                    await asyncio.sleep(0.05)
                freed_after = time.monotonic() - killed_at
            # Freed by the lease's end (renewed at most LEASE_S / 3 before the kill), not before.
            assert LEASE_S / 3 < freed_after < LEASE_S + 2

    asyncio.run(body())
