"""What Python gRPC alone costs on this machine: the floor under the stack's share of TTFT.

Two bare servers, in a child process, that do no work of their own:

    unary      a Scheduler.Submit that answers at once: CPU per call on each side, and the wall
               time of a burst of `--concurrency` concurrent calls
    streams    a Generation.GenerateStream that stamps each call's arrival: how long after the
               SDK client starts a burst of streams the last one reaches the server

`benchmarks.request_walk` measures the same hops through the real services; the difference is
the services' own work.

    python -m benchmarks.grpc_floor
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import grpc

from shardline.client import AsyncShardlineClient
from shardline.proto import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def Submit(self, request, context):
        return scheduler_pb2.SubmitResponse(queue_position=1)


class _Generation(generation_pb2_grpc.GenerationServicer):
    def __init__(self, arrivals: mp.Queue) -> None:
        self._arrivals = arrivals

    async def GenerateStream(self, request, context):
        self._arrivals.put(time.time())
        yield generation_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[1], finish_reason=2)


def _report_cpu(asks: mp.Queue, answers: mp.Queue) -> None:
    """Answers each ask with this process's CPU time: /proc counts only 10 ms ticks, too coarse
    for a short run (a CI run of 12 calls once read 0)."""
    for _ in iter(asks.get, None):
        answers.put(1000 * time.process_time())


def _serve(ports: mp.Queue, arrivals: mp.Queue, cpu_asks: mp.Queue, cpu_answers: mp.Queue) -> None:
    threading.Thread(target=_report_cpu, args=(cpu_asks, cpu_answers), daemon=True).start()

    async def main() -> None:
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(_Scheduler(), server)
        generation_pb2_grpc.add_GenerationServicer_to_server(_Generation(arrivals), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


class _ServerCpu:
    def __init__(self, asks: mp.Queue, answers: mp.Queue) -> None:
        self._asks, self._answers = asks, answers

    def ms(self) -> float:
        self._asks.put(True)
        return self._answers.get(timeout=60)


async def _unary(port: int, server_cpu: _ServerCpu, bursts: int, concurrency: int, input_len: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.SubmitRequest(
            request_id="r" * 36, gateway_id="g", model="m", prompt_token_ids=list(range(input_len))
        )
        await stub.Submit(request)  # connect first
        server0, client0, walls = server_cpu.ms(), 1000 * time.process_time(), []
        for _ in range(bursts):
            start = time.perf_counter()
            await asyncio.gather(*(stub.Submit(request) for _ in range(concurrency)))
            walls.append(1000 * (time.perf_counter() - start))
        calls = bursts * concurrency
        client1 = 1000 * time.process_time()
        return {
            "server_cpu_ms_per_call": (server_cpu.ms() - server0) / calls,
            "client_cpu_ms_per_call": (client1 - client0) / calls,
            "burst_wall_ms_median": statistics.median(walls),
        }


async def _streams(port: int, arrivals: mp.Queue, bursts: int, concurrency: int, input_len: int) -> dict[str, float]:
    async with AsyncShardlineClient(f"127.0.0.1:{port}", retries=0) as client:

        async def one() -> None:
            async for _ in client.stream(list(range(100, 100 + input_len)), max_tokens=1):
                pass

        await one()
        arrivals.get()
        last = []
        for _ in range(bursts):
            start = time.time()
            await asyncio.gather(*(one() for _ in range(concurrency)))
            last.append(1000 * (max(arrivals.get() for _ in range(concurrency)) - start))
        return {"last_arrival_ms_median": statistics.median(last), "last_arrival_ms_min": min(last)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("results/grpc_floor.json"))
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    ports, arrivals, cpu_asks, cpu_answers = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_serve, args=(ports, arrivals, cpu_asks, cpu_answers), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        unary = asyncio.run(
            _unary(port, _ServerCpu(cpu_asks, cpu_answers), args.bursts, args.concurrency, args.input_len)
        )
        streams = asyncio.run(_streams(port, arrivals, args.bursts, args.concurrency, args.input_len))
    finally:
        server.kill()
        server.join()
    print(f"bare grpc.aio, {args.bursts} bursts of {args.concurrency}, {args.input_len}-token requests")
    print(
        f"  unary: server {unary['server_cpu_ms_per_call']:.3f} ms CPU/call, client "
        f"{unary['client_cpu_ms_per_call']:.3f} ms CPU/call, burst {unary['burst_wall_ms_median']:.1f} ms (median)"
    )
    print(
        f"  SDK streams: the last of a burst reaches the server {streams['last_arrival_ms_median']:.1f} ms "
        f"after the first is sent (median; best {streams['last_arrival_ms_min']:.1f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "unary": unary, "streams": streams}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
