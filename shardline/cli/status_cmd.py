"""`shardline status`: a running `shardline up` stack's services, workers, queue and Redis."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardline.cli.one_line_errors import one_line_errors
from shardline.core.service_main import redacted
from shardline.stack.health_probe import healthy
from shardline.stack.state import StackNotRunning, StackState, pid_alive

TIMEOUT_S = 3.0  # per question: a stack that takes longer to answer is reported as not answering


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="what a running `shardline up` serves: services, workers, queue, Redis")
    p.add_argument(
        "--data-dir", type=Path, default=Path(".shardline"), help="the stack's folder, as given to `shardline up`"
    )
    p.set_defaults(func=one_line_errors("status", run))


def run(args: argparse.Namespace) -> int:
    """Prints the report; exit 0 when every part answers, 1 when one does not or no stack runs."""
    try:
        state = StackState.read(args.data_dir)
    except StackNotRunning as exc:
        print(f"shardline status: {exc}", file=sys.stderr)
        return 1
    print(f"shardline stack on {args.data_dir}: up {_duration(state.uptime_s())} (pid {state.pid})")
    ok = _print_services(state)
    ok &= _print_scheduler(state.scheduler_address)
    ok &= _print_redis(state.redis_url)
    if state.log_dir:
        print(f"\nlogs: {state.log_dir}/<service>.log")
    return 0 if ok else 1


def _print_services(state: StackState) -> bool:
    print("\nservices")
    ok = True
    for service in state.services:
        up = healthy(service.address) if service.address else pid_alive(service.pid)
        ok &= up
        where = service.address or f"pid {service.pid}"
        extra = ""
        if service.name == "gateway":
            extra = f"{state.http_url}/v1"
        elif service.name == "tracing" and state.dashboard_url:
            extra = f"dashboard {state.dashboard_url}"
        print(f"  {service.name:<12}{'up' if up else 'DOWN':<6}{where:<18}{extra}".rstrip())
    return ok


def _print_scheduler(address: str) -> bool:
    from shardline.proto import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            workers = scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=TIMEOUT_S).workers
            stats = scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            print(f"\nworkers and queue: the scheduler at {address} does not answer ({exc.code().name})")
            return False
    now = time.time()
    print(f"\nworkers: {len(workers)} registered")
    for w in workers:
        info = w.worker
        kv = f"{w.kv_blocks_used}/{info.kv_blocks_total} blocks ({_percent(w.kv_blocks_used, info.kv_blocks_total)})"
        seen_s = max(0.0, now - w.last_seen.ToNanoseconds() / 1e9)
        print(
            f"  {info.worker_id:<12}{'alive' if w.alive else 'DEAD':<6}{info.address:<18}"
            f"running {w.running}/{info.max_num_seqs}  waiting {w.waiting}  KV {kv}  seen {seen_s:.1f}s ago"
            + (f"  role {info.role}" if info.role and info.role != "both" else "")
            + ("  DRAINING" if w.draining else "")
        )
    queued = sum(stats.queue_depth.values())
    by_priority = ", ".join(f"priority {p}: {n}" for p, n in sorted(stats.queue_depth.items()) if n)
    print(f"\nqueue: {queued} queued" + (f" ({by_priority})" if by_priority else ""))
    print(f"  {stats.running} running on {stats.workers} live worker(s)")
    for scale in stats.scale:
        print(
            f"\nautoscaler ({scale.policy}): {scale.model} wants {scale.desired} worker(s): {scale.ready} ready, "
            f"{scale.starting} starting, {scale.draining} draining"
            + (f", retired {', '.join(scale.retired)}" if scale.retired else "")
        )
        print(
            f"  forecast {scale.forecast_rps:.2f} requests/s over a {scale.cold_start_s:.0f}s cold start: "
            + scale.reason
        )
    return bool(workers) and all(w.alive for w in workers)


def _print_redis(url: str) -> bool:
    client = redis.Redis.from_url(
        url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 0)
    )
    try:
        server, memory, clients = client.info("server"), client.info("memory"), client.info("clients")
        keys = client.dbsize()
    except redis.RedisError as exc:
        print(f"\nredis: {redacted(url)} does not answer ({str(exc).splitlines()[0] if str(exc) else exc!r})")
        return False
    finally:
        client.close()
    max_memory = memory.get("maxmemory_human", "0B") if memory.get("maxmemory") else "no limit"
    print(f"\nredis: {redacted(url)} reachable, version {server.get('redis_version', '?')}")
    print(
        f"  memory {memory.get('used_memory_human', '?')} (peak {memory.get('used_memory_peak_human', '?')}, "
        f"max {max_memory})  keys {keys}  clients {clients.get('connected_clients', '?')}"
    )
    return True


def _percent(used: int, total: int) -> str:
    return f"{100 * used / total:.0f}%" if total else "?"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s" if m else f"{s}s"
