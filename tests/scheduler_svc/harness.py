"""A real scheduler on a free port, with recording gateways, for component tests."""

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from scheduler_svc.server import SchedulerServer, start_scheduler
from scheduler_svc.settings import SchedulerSettings
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.scheduler_svc.scripted_worker import ScriptedWorker


def make_settings(redis_url: str, **overrides: object) -> SchedulerSettings:
    values: dict[str, object] = dict(
        host="127.0.0.1",
        port=0,
        redis_url=redis_url,
        tracing=False,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=2.0,
    )
    values.update(overrides)
    return SchedulerSettings(**values)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Waits for `predicate` to hold; generous because the test machine is shared."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


class Gateway:
    """A gateway's Subscribe stream, with every TokenBatch it received."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, gateway_id: str) -> None:
        self.gateway_id = gateway_id
        self._stub = stub
        self.batches: list[scheduler_pb2.TokenBatch] = []
        self.ended: grpc.StatusCode | None = None

    async def start(self) -> "Gateway":
        self._call = self._stub.Subscribe(scheduler_pb2.SubscribeRequest(gateway_id=self.gateway_id))
        await self._call.initial_metadata()  # the subscription is live from here
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for batch in self._call:
                self.batches.append(batch)
            self.ended = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            self.ended = exc.code()

    def deltas(self, request_id: str) -> list[common_pb2.RequestDelta]:
        return [d for batch in self.batches for d in batch.deltas if d.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for d in self.deltas(request_id) for t in d.token_ids]

    def final(self, request_id: str) -> common_pb2.RequestDelta | None:
        return next((d for d in self.deltas(request_id) if d.finish_reason), None)

    async def wait_finished(self, *request_ids: str, timeout_s: float = 10.0) -> None:
        await eventually(
            lambda: all(self.final(r) is not None for r in request_ids),
            timeout_s,
            f"{request_ids} to finish on {self.gateway_id}",
        )

    def close(self) -> None:
        self._call.cancel()


@dataclass
class Cluster:
    """A scheduler and the test's clients of it."""

    server: SchedulerServer
    stub: scheduler_pb2_grpc.SchedulerStub
    workers: list[ScriptedWorker]

    async def gateway(self, gateway_id: str) -> Gateway:
        return await Gateway(self.stub, gateway_id).start()

    async def worker(self, worker_id: str, **kwargs: object) -> ScriptedWorker:
        worker = await ScriptedWorker(worker_id, **kwargs).start(self.server.port)
        self.workers.append(worker)
        return worker

    async def submit(
        self,
        request_id: str,
        gateway_id: str = "gw-1",
        prompt: list[int] | None = None,
        max_tokens: int = 5,
        seed: int = 7,
        priority: int = 0,
        **fields: object,
    ) -> scheduler_pb2.SubmitResponse:
        params = sampling_pb2.SamplingParameters(max_tokens=max_tokens, seed=seed, temperature=0.0)
        return await self.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id=request_id,
                gateway_id=gateway_id,
                model="test-model",
                prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
                params=params,
                eos_token_ids=[2],
                priority=priority,
                **fields,
            )
        )

    async def info(self, request_id: str) -> common_pb2.RequestInfo:
        return await self.stub.GetRequest(common_pb2.GetRequestRequest(request_id=request_id))


@asynccontextmanager
async def cluster(redis_url: str, tracer: trace.Tracer | None = None, **overrides: object) -> AsyncIterator[Cluster]:
    """A started scheduler; stops it and its scripted workers afterwards."""
    server = await start_scheduler(make_settings(redis_url, **overrides), tracer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    running = Cluster(server, scheduler_pb2_grpc.SchedulerStub(channel), [])
    try:
        yield running
    finally:
        # Each step bounded: a teardown that waits forever on a dead stream would hide the test's result.
        for worker in running.workers:
            await asyncio.wait_for(worker.kill(), timeout=10)
        await asyncio.wait_for(channel.close(), timeout=10)
        await asyncio.wait_for(server.stop(grace_s=0), timeout=30)


def by_gateway_and_step(gateway: Gateway) -> dict[tuple[str, int], int]:
    """How many TokenBatches the gateway got per (worker, step)."""
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for batch in gateway.batches:
        counts[(batch.worker_id, batch.step)] += 1
    return counts
