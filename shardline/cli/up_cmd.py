"""`shardline up`: the whole stack in the foreground, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from shardline.cli.arg_types import at_least_one, tcp_port
from shardline.service_main import redacted
from shardline.signals import STOP_SIGNALS
from shardline.stack import LocalStack, StackConfig, StartInterrupted


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start redis, tokenizer, scheduler, workers and gateway on this machine")
    p.add_argument(
        "--model",
        default=os.environ.get("SHARDLINE_MODEL") or None,
        help="HF folder or .gguf file (default: $SHARDLINE_MODEL, else SmolLM2-135M-Instruct)",
    )
    p.add_argument("--workers", type=at_least_one, default=1, help="number of GPU worker services")
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel size of each worker")
    p.add_argument("--http-port", type=tcp_port, default=8000)
    p.add_argument("--grpc-port", type=tcp_port, default=50051)
    p.add_argument("--redis-url", default=None, help="external Redis (default: an embedded redis-server)")
    p.add_argument("--data-dir", type=Path, default=Path(".shardline"), help="embedded Redis data (AOF)")
    p.add_argument("--tracing", action="store_true", help="start the tracing service and export spans to it")
    p.add_argument("--log-dir", type=Path, default=None, help="write each service's log to a file here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.http_port == args.grpc_port:  # else the gateway, started last, would fail to bind
        print(f"shardline up: --http-port and --grpc-port are both {args.http_port}; give two ports", file=sys.stderr)
        return 2
    config = StackConfig(
        model=args.model,
        workers=args.workers,
        tp_size=args.tp,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        redis_url=args.redis_url,
        data_dir=args.data_dir,
        tracing=args.tracing,
        log_dir=args.log_dir,
    )
    stack = LocalStack(config)
    t0 = time.monotonic()
    print(
        f"shardline: starting {args.workers} worker(s) at TP {args.tp} with "
        f"{args.model or 'SmolLM2-135M-Instruct (default)'} ...",
        flush=True,
    )
    # Ctrl-C, SIGTERM and a closed terminal (SIGHUP) stop `up`, while starting as after: the services
    # must not outlive it. The handler only notes the signal, and the code polls: a handler that
    # raises is lost in a __del__, and one that sets a threading.Event deadlocks if it lands while
    # the main thread holds the Event's lock in wait().
    received: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    try:
        stack.start(
            progress=lambda msg: print(f"  [{time.monotonic() - t0:5.1f}s] {msg}", flush=True),
            interrupted=lambda: bool(received),
        )
        if received:  # after start()'s last look
            stack.stop()
            raise StartInterrupted
    except StartInterrupted:
        print("shardline: interrupted while starting; stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:  # OSError: a data or log folder it cannot write
        print(f"shardline: failed to start: {exc}", file=sys.stderr)
        return 1
    traces = (
        f"\n  traces        http://127.0.0.1:{config.dashboard_port}/   (dashboard; OTLP on :{config.otlp_port})"
        f"\n                shardline trace export --redis-url {redacted(stack.redis_url)} --last 1"
        if args.tracing
        else ""
    )
    print(
        f"""
shardline is up ({time.monotonic() - t0:.1f}s):
  OpenAI HTTP   http://127.0.0.1:{args.http_port}/v1   (curl .../v1/completions, .../v1/chat/completions)
  gRPC          127.0.0.1:{args.grpc_port}           (shardline.client.ShardlineClient)
  metrics       http://127.0.0.1:{args.http_port}/metrics{traces}
  redis         {redacted(stack.redis_url)}
Ctrl-C stops everything.""",
        flush=True,
    )
    # A supervisor, like compose's `restart: unless-stopped`: every service rebuilds its state from
    # Redis, and the scheduler re-dispatches a dead worker's requests meanwhile. One that crash-loops
    # is restarted with backoff and reported, and the others keep serving.
    supervisor = stack.supervisor(report=lambda msg: print(f"shardline: {msg}", file=sys.stderr, flush=True))
    while not received:
        time.sleep(0.2)  # a signal ends the sleep early only if its handler raises; 0.2 s is soon enough
        supervisor.check()
    print("shardline: shutting down ...", flush=True)
    stack.stop()
    return 0
