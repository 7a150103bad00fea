"""Overload: N requests arrive at once; every answer must be a 200 or a 429 (OK or RESOURCE_EXHAUSTED
over gRPC), and a 429 must come back fast, since a refusal is only useful if it is cheap.

    python -m benchmarks.overload_burst                        # a private stack, 2,000 at once, 2 rounds
    python -m benchmarks.overload_burst --url 127.0.0.1:8000 --grpc-url 127.0.0.1:50051

HTTP is sent from raw sockets, so that the client costs next to nothing beside the gateway on a
small machine: all N connections are opened first (the gateway's accept backlog holds them), then
each request's bytes are written in one tight loop and each is timed from its own write to the
first byte of its answer. An HTTP client library's own queueing would otherwise be most of what is
measured. gRPC goes through grpc.aio on one channel, timed from each call's start to its status.

Each round also sends the same HTTP burst to a bare aiohttp server in its own process that answers
every request with a 429 at once: the floor of any single-process aiohttp front end on this
machine, measured side by side with the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import selectors
import socket
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
from aiohttp import web

from shardline.core.ports import free_port
from shardline.proto import generation_pb2, generation_pb2_grpc
from shardline.stack.local_stack import LocalStack, StackConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--url", default=None, help="a running stack's HTTP host:port (default: start one)")
    p.add_argument("--grpc-url", default=None, help="a running stack's gRPC host:port")
    p.add_argument("--queue-capacity", type=int, default=256, help="for the private stack")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def _request_bytes(host: str, model: str) -> bytes:
    fields = {"model": model} if model else {}  # none: the default model
    body = json.dumps({**fields, "prompt": "Hello", "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def http_burst(url: str, model: str, count: int, timeout_s: float = 300.0) -> list[tuple[int, float]]:
    """(status, seconds from the write to the answer's first byte) of `count` requests sent at once."""
    host, port = url.rsplit(":", 1)
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)))
        sock.setblocking(False)
        socks.append(sock)
    payload = _request_bytes(url, model)
    sent: dict[socket.socket, float] = {}
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.sendall(payload)  # a few hundred bytes: the socket buffer takes them whole
        sent[sock] = time.perf_counter()
        selector.register(sock, selectors.EVENT_READ)
    first: dict[socket.socket, float] = {}
    head: dict[socket.socket, bytes] = {sock: b"" for sock in socks}
    deadline = time.monotonic() + timeout_s
    results: list[tuple[int, float]] = []
    while len(results) < count and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            sock = key.fileobj
            now = time.perf_counter()
            data = sock.recv(65536)
            first.setdefault(sock, now)
            head[sock] += data[:64] if len(head[sock]) < 64 else b""
            if not data:  # Connection: close, so the answer ends with the connection
                selector.unregister(sock)
                sock.close()
                status = int(head[sock].split(b" ", 2)[1]) if head[sock].startswith(b"HTTP/") else 0
                results.append((status, first[sock] - sent[sock]))
    for key in list(selector.get_map().values()):  # no answer in time: counted as status 0
        results.append((0, timeout_s))
        key.fileobj.close()
    return results


async def grpc_burst(url: str, model: str, count: int) -> list[tuple[str, float]]:
    details: list[str] = []
    try:
        return await _grpc_burst(url, model, count, details)
    finally:
        for detail, n in Counter(details).most_common(5):  # what any status but the two expected said
            print(f"  {n} x {detail}", flush=True)


async def _grpc_burst(url: str, model: str, count: int, details: list[str]) -> list[tuple[str, float]]:
    async with grpc.aio.insecure_channel(url) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await channel.channel_ready()

        async def one() -> tuple[str, float]:
            start = time.perf_counter()
            request = generation_pb2.GenerateRequest(model=model, prompt="Hello")
            request.params.max_tokens = 1
            try:
                await stub.Generate(request, timeout=300)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                if exc.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED,):
                    details.append(f"{code}: {exc.details()}")
            return code, time.perf_counter() - start

        return await asyncio.gather(*(one() for _ in range(count)))


def _bare_refuser(port: int) -> None:
    async def refuse(_: web.Request) -> web.Response:
        body = {"error": {"message": "full", "type": "rate_limit_error"}}
        return web.json_response(body, status=429, headers={"Retry-After": "1"})

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", refuse)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


def _ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else 1000 * sum(values)


def summarise(results: list[tuple[object, float]], refused: object) -> dict:
    counts = Counter(str(status) for status, _ in results)
    refusals = [s for status, s in results if status == refused]
    admitted = [s for status, s in results if status != refused]
    summary: dict = {"counts": dict(counts)}
    for name, values in (("refused", refusals), ("admitted", admitted)):
        if values:
            summary[name] = {f"p{q}_ms": round(_ms(values, q), 1) for q in (50, 90, 99)}
            summary[name]["max_ms"] = round(1000 * max(values), 1)
    return summary


def wait_idle(url: str, model: str) -> None:
    """Until the queue left by a burst has drained: a request is admitted again."""
    for _ in range(600):
        if http_burst(url, model, 1)[0][0] == 200:
            return
        time.sleep(0.5)


def run(http_url: str, grpc_url: str, model: str, args: argparse.Namespace) -> dict:
    floor_port = free_port()
    floor = multiprocessing.get_context("spawn").Process(target=_bare_refuser, args=(floor_port,), daemon=True)
    floor.start()
    for _ in range(100):  # until it listens
        try:
            socket.create_connection(("127.0.0.1", floor_port)).close()
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
    rounds = []
    try:
        for r in range(args.rounds):
            wait_idle(http_url, model)
            http = summarise(http_burst(http_url, model, args.requests), 429)
            print(f"round {r + 1} HTTP: {json.dumps(http)}", flush=True)
            bare = summarise(http_burst(f"127.0.0.1:{floor_port}", model, args.requests), 429)
            print(f"round {r + 1} bare aiohttp floor: {json.dumps(bare)}", flush=True)
            wait_idle(http_url, model)
            over_grpc = summarise(asyncio.run(grpc_burst(grpc_url, model, args.requests)), "RESOURCE_EXHAUSTED")
            print(f"round {r + 1} gRPC: {json.dumps(over_grpc)}", flush=True)
            rounds.append({"http": http, "bare_aiohttp_floor": bare, "grpc": over_grpc})
    finally:
        floor.kill()
    return {"requests": args.requests, "rounds": rounds}


def main() -> None:
    args = parse_args()
    if args.url:
        report = run(args.url, args.grpc_url or args.url, "", args)
    else:
        with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
            config = StackConfig.on_free_ports(
                workers=1, data_dir=Path(tmp), env={"QUEUE_CAPACITY": str(args.queue_capacity)}
            )
            with LocalStack(config).start(timeout_s=300):
                report = run(f"127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}", "", args)
    report["queue_capacity"] = args.queue_capacity
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
