"""`shardline up`: the whole stack in the foreground, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from shardline.cli.arg_types import at_least_one, at_least_zero, tcp_port
from shardline.cli.serve_extra import require_serve
from shardline.cli.service_logs import ServiceLogFollower
from shardline.core.service_main import redacted
from shardline.stack.local_scaler import LocalWorkerScaler
from shardline.stack.local_stack import LocalStack, StackConfig, StartInterrupted
from shardline.stack.signals import STOP_SIGNALS
from shardline.stack.state import ServiceEntry, StackState


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start redis, tokenizer, scheduler, workers and gateway on this machine")
    p.add_argument(
        "--model",
        default=os.environ.get("SHARDLINE_MODEL") or None,
        help="HF folder or .gguf file (default: $SHARDLINE_MODEL, else SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter in folder PATH (PEFT's format) on every worker as model NAME; once per adapter",
    )
    workers = p.add_mutually_exclusive_group()
    workers.add_argument("--workers", type=at_least_one, default=1, help="number of GPU worker services")
    workers.add_argument(
        "--decode-workers",
        type=at_least_one,
        default=None,
        help="the workers that run requests, of role decode (with --prefill-workers; instead of --workers)",
    )
    p.add_argument(
        "--prefill-workers",
        type=at_least_zero,
        default=0,
        help="workers of role prefill, which compute long prompts' KV for the decode workers (docs/kv_transfer.md)",
    )
    p.add_argument("--tp", type=at_least_one, default=1, help="tensor-parallel size of each worker")
    p.add_argument(
        "--autoscale",
        choices=["static", "reactive", "naive", "lt-u", "lt-ua"],
        default="static",
        help="the scheduler's autoscaling policy (docs/autoscaling.md); static (default): --workers stay",
    )
    p.add_argument(
        "--min-workers", type=at_least_one, default=None, help="with --autoscale: fewest workers (default --workers)"
    )
    p.add_argument(
        "--max-workers", type=at_least_one, default=None, help="with --autoscale: most workers (default --min-workers)"
    )
    p.add_argument(
        "--batch-workers", type=at_least_zero, default=1, help="Celery workers running /v1/batches jobs (default 1)"
    )
    p.add_argument("--http-port", type=tcp_port, default=8000)
    p.add_argument("--grpc-port", type=tcp_port, default=50051)
    p.add_argument("--redis-url", default=None, help="external Redis (default: an embedded redis-server)")
    p.add_argument(
        "--data-dir", type=Path, default=Path(".shardline"), help="embedded Redis data (AOF), logs, the stack's ports"
    )
    p.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the tracing service and its dashboard, and export spans to it (default: on)",
    )
    p.add_argument("--otlp-port", type=tcp_port, default=4317, help="the tracing service's OTLP/gRPC receiver")
    p.add_argument("--dashboard-port", type=tcp_port, default=8080, help="the trace dashboard (HTTP)")
    p.add_argument(
        "--log-dir", type=Path, default=None, help="write each service's log to a file here (default: DATA_DIR/logs)"
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="every service's log lines on the console, not only errors (without --log-dir, in no file)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_serve("up")
    ports = {"--http-port": args.http_port, "--grpc-port": args.grpc_port}
    if args.tracing:
        ports |= {"--otlp-port": args.otlp_port, "--dashboard-port": args.dashboard_port}
    for flag, port in ports.items():  # else the service started later would fail to bind
        clash = [other for other, p in ports.items() if p == port and other != flag]
        if clash:
            print(f"shardline up: {flag} and {clash[0]} are both {port}; give two ports", file=sys.stderr)
            return 2
    # Without --verbose the services' logs go to files, as `docker compose up -d` keeps them, and the
    # console shows the progress, the endpoints and the errors; --verbose alone keeps them on it.
    log_dir = args.log_dir or (None if args.verbose else args.data_dir / "logs")
    workers = args.decode_workers or args.workers
    min_workers = args.min_workers or workers
    max_workers = args.max_workers or min_workers
    if max_workers < min_workers:
        print(f"shardline up: --max-workers {max_workers} is below --min-workers {min_workers}", file=sys.stderr)
        return 2
    autoscaling = args.autoscale != "static"
    config = StackConfig(
        model=args.model,
        workers=min_workers if autoscaling else workers,
        prefill_workers=args.prefill_workers,
        autoscale=args.autoscale,
        min_workers=min_workers,
        max_workers=max_workers,
        batch_workers=args.batch_workers,
        tp_size=args.tp,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        redis_url=args.redis_url,
        data_dir=args.data_dir,
        tracing=args.tracing,
        otlp_port=args.otlp_port,
        dashboard_port=args.dashboard_port,
        log_dir=log_dir,
        lora_adapters=",".join(args.lora),
    )
    stack = LocalStack(config)
    t0 = time.monotonic()
    roles = f" ({config.prefill_workers} prefill, {config.workers} decode)" if config.prefill_workers else ""
    print(
        f"shardline: starting {config.workers + config.prefill_workers} worker(s){roles} at TP {args.tp} with "
        f"{args.model or 'SmolLM2-135M-Instruct (default)'} ...",
        flush=True,
    )
    follower = None
    if log_dir is not None:
        print(
            f"  logs in {log_dir}/<service>.log" + ("" if args.verbose else " (--verbose shows them here)"), flush=True
        )
        follower = ServiceLogFollower(log_dir, _to_stderr, verbose=args.verbose).start()
    try:
        return _run(args, stack, t0)
    finally:
        if follower is not None:
            follower.stop()


def _run(args: argparse.Namespace, stack: LocalStack, t0: float) -> int:
    config = stack.config
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
        hint = ""
        if config.tracing and str(exc).startswith("tracing "):
            hint = "\n  (--otlp-port and --dashboard-port move the tracing service; --no-tracing goes without)"
        print(f"shardline: failed to start: {exc}{hint}", file=sys.stderr)
        return 1
    state = _state(stack)
    _write(state, args.data_dir)
    print(_banner(stack, state, time.monotonic() - t0), flush=True)
    # A supervisor, like compose's `restart: unless-stopped`: every service rebuilds its state from
    # Redis, and the scheduler re-dispatches a dead worker's requests meanwhile. One that crash-loops
    # is restarted with backoff and reported, and the others keep serving.
    supervisor = stack.supervisor(report=lambda msg: _to_stderr(f"shardline: {msg}"))
    scaler = None
    if config.autoscale != "static":  # the scheduler decides; this process starts and stops the workers
        scaler = LocalWorkerScaler(stack, report=lambda msg: print(f"shardline: {msg}", flush=True))
    try:
        while not received:
            time.sleep(0.2)  # a signal ends the sleep early only if its handler raises; 0.2 s is soon enough
            supervisor.check()
            if scaler is not None:
                scaler.check()
            services = _services(stack)
            if services != state.services:  # a restart: `status` checks the new process
                state.services = services
                _write(state, args.data_dir)
        print("shardline: shutting down ...", flush=True)
        stack.stop()
    finally:
        if scaler is not None:
            scaler.close()
        state.remove(args.data_dir)
    return 0


def _write(state: StackState, data_dir: Path) -> None:
    try:
        state.write(data_dir)
    except OSError as exc:  # the stack serves on; only `shardline status` cannot see it
        _to_stderr(f"shardline: cannot write {data_dir}: {exc}; `shardline status` will not see this stack")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _services(stack: LocalStack) -> list[ServiceEntry]:
    return [ServiceEntry(child.name, child.health, child.proc.pid) for child in stack.children]


def _state(stack: LocalStack) -> StackState:
    c = stack.config
    return StackState(
        pid=os.getpid(),
        started_at=time.time(),
        redis_url=stack.redis_url,
        scheduler_address=f"127.0.0.1:{c.scheduler_port}",
        http_url=f"http://127.0.0.1:{c.http_port}",
        grpc_address=f"127.0.0.1:{c.grpc_port}",
        dashboard_url=f"http://127.0.0.1:{c.dashboard_port}/" if c.tracing else None,
        log_dir=str(c.log_dir) if c.log_dir is not None else None,
        services=_services(stack),
    )


def _banner(stack: LocalStack, state: StackState, took_s: float) -> str:
    c = stack.config
    traces = (
        f"\n  traces        {state.dashboard_url}   (dashboard; OTLP on :{c.otlp_port})"
        f"\n                shardline trace export --redis-url {redacted(stack.redis_url)} --last 1"
        if state.dashboard_url
        else ""
    )
    logs = f"\n  logs          {c.log_dir}/<service>.log" if c.log_dir is not None else ""
    if c.autoscale != "static":
        logs += f"\n  autoscale     {c.autoscale}, {c.min_workers} to {c.max_workers} workers (shardline status)"
    status = "" if c.data_dir == Path(".shardline") else f" --data-dir {c.data_dir}"
    return f"""
shardline is up ({took_s:.1f}s):
  OpenAI HTTP   {state.http_url}/v1   (curl .../v1/completions, .../v1/chat/completions)
  gRPC          {state.grpc_address}           (shardline.client.ShardlineClient)
  batches       {state.http_url}/v1/batches   ({c.batch_workers} batch worker(s); shardline batch --help)
  metrics       {state.http_url}/metrics{traces}
  redis         {redacted(stack.redis_url)}{logs}
  status        shardline status{status}
Ctrl-C stops everything."""
