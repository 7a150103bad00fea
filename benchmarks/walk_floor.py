"""The floor under the stack's share of TTFT: the request's walk through services that do no work.

`shardline bench --engine` compares the stack with the engine in-process. For a burst, the stack
adds the time for the last request of the burst to reach the worker (client -> gateway ->
scheduler -> worker) and the time for the step's first tokens to come back (worker -> scheduler
-> gateway -> client). This benchmark measures those two hops with bare stand-ins for the three
services, each in a process of its own, on the same RPCs and messages as the real ones, and with
the one Redis round trip per request that the architecture requires before a request is queued
(the real `RequestStore.create`, on a private redis-server):

    gateway    Generation.GenerateStream: Scheduler.Submit, then wait for the request's delta on the
               gateway's one Subscribe stream
    scheduler  Submit: persist the request (Redis), put it on the worker's Session stream;
               relay each StepOutput to the gateway as one TokenBatch
    worker     Session: once the burst's last request has come, one StepOutput with a token for each

There is no tokenization, validation, queueing policy, tracing, engine or admission wait: what it
measures is grpc, protobuf, asyncio and one Redis write. The client is the SDK's
`AsyncShardlineClient`, as in `shardline bench`. A burst's median TTFT here is the least the
stack can add to the engine's TTFT p50 on this machine; `benchmarks.request_walk` measures the
same hops through the real services.

Two variants bound other designs: `--streamed-submit` sends the gateway's requests to the scheduler
on one stream (and their tokens back on it) instead of a unary Submit each, and `--no-redis`
leaves the Redis write out.

    python -m benchmarks.walk_floor
    python -m benchmarks.walk_floor --streamed-submit --no-redis
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import redis as redis_py

from shardline.client import AsyncShardlineClient
from shardline.client.channel_options import CHANNEL_OPTIONS
from shardline.core.store.request_record import RequestRecord
from shardline.core.store.request_store import PREFIX, RequestStore
from shardline.proto import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from shardline.stack.redis_server import EmbeddedRedis

_LENGTH = sampling_pb2.FINISH_REASON_LENGTH


async def _serve(servicer_adder, servicer, ports: mp.Queue, *more) -> grpc.aio.Server:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    for adder, added in ((servicer_adder, servicer), *more):
        adder(added, server)
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    return server


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Answers a burst in one step as soon as its last request is in; stamps when it sends."""

    def __init__(self, burst: int, stamps: mp.Queue) -> None:
        self._burst, self._stamps = burst, stamps

    async def Session(self, request_iterator, context):
        pending: list[str] = []
        step = 0
        async for command in request_iterator:
            pending.extend(add.request_id for add in command.add)
            if len(pending) >= self._burst:
                step += 1
                self._stamps.put(time.time())
                yield worker_pb2.StepOutput(
                    step=step,
                    deltas=[
                        common_pb2.RequestDelta(request_id=r, token_ids=[1], finish_reason=_LENGTH) for r in pending
                    ],
                )
                pending = []


def _run_worker(burst: int, stamps: mp.Queue, ports: mp.Queue) -> None:
    async def main() -> None:
        server = await _serve(worker_pb2_grpc.add_WorkerServicer_to_server, _Worker(burst, stamps), ports)
        await server.wait_for_termination()

    asyncio.run(main())


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Persists each request, dispatches it on the worker's session, relays the worker's steps."""

    def __init__(self, store: RequestStore | None) -> None:
        self._store = store
        self._commands: asyncio.Queue[worker_pb2.WorkerCommand] = asyncio.Queue()
        self._subscribers: dict[str, asyncio.Queue[worker_pb2.StepOutput]] = {}

    async def relay(self, worker_port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker_port}", options=CHANNEL_OPTIONS) as channel:
            session = worker_pb2_grpc.WorkerStub(channel).Session(_drain(self._commands))
            async for step in session:
                for queue in self._subscribers.values():
                    queue.put_nowait(step)

    async def submit(self, request_id: str, prompt_token_ids, params: sampling_pb2.SamplingParameters) -> None:
        if self._store is not None:
            record = RequestRecord(request_id=request_id, model="m", params={"max_tokens": 1}, gateway_id="g")
            await self._store.create(record, prompt_token_ids)
        self._commands.put_nowait(
            worker_pb2.WorkerCommand(
                add=[worker_pb2.NewRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, params=params)]
            )
        )

    async def Submit(self, request, context):
        await self.submit(request.request_id, request.prompt_token_ids, request.params)
        return scheduler_pb2.SubmitResponse(queue_position=1)

    def subscribe(self, gateway_id: str) -> asyncio.Queue[worker_pb2.StepOutput]:
        """The queue of the worker's steps for one gateway."""
        queue = self._subscribers[gateway_id] = asyncio.Queue()
        return queue

    async def Subscribe(self, request, context):
        queue = self.subscribe(request.gateway_id)
        while True:
            step = await queue.get()
            yield scheduler_pb2.TokenBatch(worker_id="w", step=step.step, deltas=step.deltas)


class _StreamedSubmit(worker_pb2_grpc.WorkerServicer):
    """--streamed-submit: the gateway's requests come in on one stream (the Session RPC's shape,
    WorkerCommand in and StepOutput out) instead of a unary Submit each, and the steps go back on it."""

    def __init__(self, scheduler: _Scheduler) -> None:
        self._scheduler = scheduler

    async def Session(self, request_iterator, context):
        queue = self._scheduler.subscribe("g")

        async def submit_all() -> None:
            async for command in request_iterator:
                for add in command.add:
                    await self._scheduler.submit(add.request_id, add.prompt_token_ids, add.params)

        submitting = asyncio.create_task(submit_all())
        try:
            while True:
                yield await queue.get()
        finally:
            submitting.cancel()


async def _drain(queue: asyncio.Queue):
    while True:
        yield await queue.get()


def _run_scheduler(worker_port: int, redis_url: str | None, ports: mp.Queue) -> None:
    async def main() -> None:
        scheduler = _Scheduler(RequestStore(redis_url) if redis_url else None)
        server = await _serve(
            scheduler_pb2_grpc.add_SchedulerServicer_to_server,
            scheduler,
            ports,
            (worker_pb2_grpc.add_WorkerServicer_to_server, _StreamedSubmit(scheduler)),
        )
        await scheduler.relay(worker_port)
        await server.wait_for_termination()

    asyncio.run(main())


class _Gateway(generation_pb2_grpc.GenerationServicer):
    """Submits each stream's request and answers it from the gateway's one Subscribe stream."""

    def __init__(self, channel: grpc.aio.Channel, streamed_submit: bool) -> None:
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        self._session = worker_pb2_grpc.WorkerStub(channel) if streamed_submit else None
        self._submits: asyncio.Queue[worker_pb2.WorkerCommand] = asyncio.Queue()
        self._waiting: dict[str, asyncio.Future[common_pb2.RequestDelta]] = {}

    async def relay(self) -> None:
        if self._session is not None:
            batches = self._session.Session(_drain(self._submits))
        else:
            batches = self._scheduler.Subscribe(scheduler_pb2.SubscribeRequest(gateway_id="g"))
        async for batch in batches:
            for delta in batch.deltas:
                self._waiting.pop(delta.request_id).set_result(delta)

    async def GenerateStream(self, request, context):
        done = self._waiting[request.request_id] = asyncio.get_running_loop().create_future()
        if self._session is not None:
            self._submits.put_nowait(
                worker_pb2.WorkerCommand(
                    add=[
                        worker_pb2.NewRequest(
                            request_id=request.request_id,
                            prompt_token_ids=request.prompt_token_ids.ids,
                            params=request.params,
                        )
                    ]
                )
            )
        else:
            await self._scheduler.Submit(
                scheduler_pb2.SubmitRequest(
                    request_id=request.request_id,
                    gateway_id="g",
                    model="m",
                    prompt_token_ids=request.prompt_token_ids.ids,
                    params=request.params,
                )
            )
        delta = await done
        yield generation_pb2.GenerateStreamResponse(
            request_id=request.request_id, token_ids=delta.token_ids, finish_reason=delta.finish_reason
        )


def _run_gateway(scheduler_port: int, streamed_submit: bool, ports: mp.Queue) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_port}", options=CHANNEL_OPTIONS) as channel:
            gateway = _Gateway(channel, streamed_submit)
            relay = asyncio.create_task(gateway.relay())
            server = await _serve(generation_pb2_grpc.add_GenerationServicer_to_server, gateway, ports)
            await asyncio.sleep(0.5)  # the Subscribe stream is open before the first request comes
            ports.put(True)
            await relay
            await server.wait_for_termination()

    asyncio.run(main())


async def _bursts(port: int, stamps: mp.Queue, bursts: int, concurrency: int, input_len: int) -> list[dict[str, float]]:
    """Each burst's hops: the last dispatch (from the burst's first send), the relay (the worker's
    send to the median stream's first chunk), and TTFT p50 with each request timed from just before
    its own send, as `shardline bench` times it."""
    async with AsyncShardlineClient(f"127.0.0.1:{port}", retries=0) as client:

        async def first_chunk() -> tuple[float, float]:
            start = time.time()
            async for _ in client.stream(list(range(100, 100 + input_len)), max_tokens=1):
                return start, time.time()
            raise RuntimeError("the stream ended without a chunk")

        await asyncio.gather(*(first_chunk() for _ in range(concurrency)))  # warm-up, not timed
        stamps.get(timeout=60)
        results = []
        for _ in range(bursts):
            times = await asyncio.gather(*(first_chunk() for _ in range(concurrency)))
            first_send, sent = min(start for start, _ in times), stamps.get(timeout=60)
            results.append(
                {
                    "last_dispatch_ms": 1000 * (sent - first_send),
                    "relay_ms": 1000 * (statistics.median(end for _, end in times) - sent),
                    "ttft_p50_ms": 1000 * statistics.median(end - start for start, end in times),
                }
            )
        return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--no-redis", action="store_true", help="leave out the Redis write (to see its share)")
    ap.add_argument(
        "--streamed-submit",
        action="store_true",
        help="the gateway submits on one stream to the scheduler, not a unary call per request",
    )
    ap.add_argument("--out", type=Path, default=Path("results/walk_floor.json"))
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    ports, stamps = ctx.Queue(), ctx.Queue()
    children: list[mp.Process] = []

    def start(target, *target_args) -> int:
        child = ctx.Process(target=target, args=(*target_args, ports), daemon=True)
        child.start()
        children.append(child)
        return ports.get(timeout=60)

    with tempfile.TemporaryDirectory() as data, EmbeddedRedis(Path(data)) as redis:
        try:
            worker = start(_run_worker, args.concurrency, stamps)
            scheduler = start(_run_scheduler, worker, None if args.no_redis else redis.url)
            gateway = start(_run_gateway, scheduler, args.streamed_submit)
            ports.get(timeout=60)  # the gateway is subscribed
            bursts = asyncio.run(_bursts(gateway, stamps, args.bursts, args.concurrency, args.input_len))
            persisted = (
                0
                if args.no_redis
                else sum(
                    1 for _ in redis_py.Redis.from_url(redis.url).scan_iter(f"{PREFIX}req:*", count=1000, _type="HASH")
                )
            )
        finally:
            for child in reversed(children):  # the gateway first: a child whose peer died first would complain
                child.kill()
                child.join()
    summary = {
        key: {
            "median": statistics.median(b[key] for b in bursts),
            "min": min(b[key] for b in bursts),
            "max": max(b[key] for b in bursts),
        }
        for key in ("last_dispatch_ms", "relay_ms", "ttft_p50_ms")
    }
    work = ("no work" if args.no_redis else "no work but one Redis write per request") + (
        "; requests submitted on one stream" if args.streamed_submit else ""
    )
    print(
        f"bare services ({work}), {args.bursts} bursts of {args.concurrency} "
        f"streams, {args.input_len}-token prompts; ms"
    )
    print(f"  {'hop':<44}{'min':>8}{'median':>8}{'max':>8}")
    for key, label in (
        ("last_dispatch_ms", "last of the burst reaches the worker"),
        ("relay_ms", "worker's step -> client (median stream)"),
        ("ttft_p50_ms", "TTFT p50 (each from its own send)"),
    ):
        s = summary[key]
        print(f"  {label:<44}{s['min']:>8.1f}{s['median']:>8.1f}{s['max']:>8.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "summary": summary,
                "requests_persisted": persisted,
                "bursts": bursts,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
