"""The autoscaler live, on a private stack with the local driver: how long a load step takes to get a
new worker serving, and how long the end of the load takes to drain the pool back.

    python -m benchmarks.autoscale_live                     # lt-ua, 1 to 2 workers
    python -m benchmarks.autoscale_live --policy reactive --rounds 2

Each round: one worker idle; then `--clients` closed-loop streams (a step of load); the stack's
LocalWorkerScaler (what `shardline up --autoscale` runs) follows the scheduler. Timed from the step:
the decision (the scheduler's desired count rises), the new worker registered (the cold start the
scheduler measured), and the first request the new worker serves. Then the load falls; timed from
there: the decision down, the drained worker retired, and its process gone. The load falls to
`--tail-clients` streams rather than to none, so the drained worker has requests to finish; a
request that fails while the pool scales fails the benchmark. The scale-down waits
out `--scale-down-window-s` (an HPA's stabilisation) by design; the drain itself is what follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from shardline.client import ShardlineClient
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from shardline.stack.local_scaler import LocalWorkerScaler
from shardline.stack.local_stack import LocalStack, StackConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="lt-ua", choices=["reactive", "naive", "lt-u", "lt-ua"])
    p.add_argument("--max-workers", type=int, default=2)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--tail-clients", type=int, default=2, help="clients that stay on after the step, to be drained")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--interval-s", type=float, default=2.0)
    p.add_argument("--scale-down-window-s", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None, help="keep each round's service logs here")
    return p.parse_args()


class _Watch:
    """Runs the local driver and the supervisor in this thread (the stack's), as `shardline up` does,
    while waiting for the scheduler to reach a state."""

    def __init__(self, stack: LocalStack, scaler: LocalWorkerScaler, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.scaler, self.stub = scaler, stub
        self.supervisor = stack.supervisor(report=lambda msg: print(f"  {msg}", flush=True))

    def scale(self) -> scheduler_pb2.ModelScale | None:
        stats = self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        return stats.scale[0] if stats.scale else None

    def until(self, done: Callable[[scheduler_pb2.ModelScale | None], bool], since: float, timeout_s: float) -> float:
        while True:
            self.supervisor.check()
            self.scaler.check()
            if done(self.scale()):
                return time.monotonic() - since
            if time.monotonic() - since > timeout_s:
                raise TimeoutError(f"not reached in {timeout_s:.0f}s: {self.scale()}")
            time.sleep(0.1)

    def serving(self, worker_id: str) -> bool:
        listed = self.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        return any(w.worker.worker_id == worker_id and w.running > 0 for w in listed.workers)

    def draining(self) -> int | None:
        """The requests still running on a draining worker, or None while none drains."""
        listed = self.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5)
        return next((w.running for w in listed.workers if w.draining), None)


def one_round(args: argparse.Namespace, data_dir: Path, log_dir: Path) -> dict[str, float]:
    config = StackConfig.on_free_ports(
        workers=1,
        autoscale=args.policy,
        min_workers=1,
        max_workers=args.max_workers,
        data_dir=data_dir,
        log_dir=log_dir,
        env={
            "KV_CACHE_BYTES": str(64 << 20),
            "MAX_NUM_SEQS": "4",
            "HEARTBEAT_INTERVAL_S": "0.5",
            "AUTOSCALE_INTERVAL_S": str(args.interval_s),
            "AUTOSCALE_SCALE_DOWN_WINDOW_S": str(args.scale_down_window_s),
        },
    )
    with LocalStack(config).start(timeout_s=300) as stack, ShardlineClient(f"127.0.0.1:{config.grpc_port}") as client:
        channel = grpc.insecure_channel(f"127.0.0.1:{config.scheduler_port}")
        watch = _Watch(
            stack,
            LocalWorkerScaler(stack, report=lambda msg: print(f"  {msg}", flush=True), poll_s=0.2),
            scheduler_pb2_grpc.SchedulerStub(channel),
        )
        watch.until(lambda s: s is not None and s.desired == 1, time.monotonic(), 60)  # the first round has run
        done, failed = [0], []
        stops = [threading.Event() for _ in range(args.clients)]

        def load(index: int) -> None:
            while not stops[index].is_set():
                try:
                    client.generate(f"Client {index}: say something.", max_tokens=args.output_len, ignore_eos=True)
                    done[0] += 1
                except Exception as exc:  # noqa: BLE001 - counted: scaling must fail no request
                    failed.append(repr(exc))

        step = time.monotonic()
        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        decided = watch.until(lambda s: s is not None and s.desired > 1, step, 300)
        registered = watch.until(lambda s: s is not None and s.ready > 1, step, 600)
        cold_start = watch.scale().cold_start_s
        serving = watch.until(lambda s: watch.serving("worker-1"), step, 300)
        # The load falls to --tail-clients, not to nothing, so that the worker chosen for removal
        # has requests of its own to drain.
        for event in stops[args.tail_clients :]:
            event.set()
        for thread in threads[args.tail_clients :]:
            thread.join(timeout=300)
        low = time.monotonic()
        down = watch.until(lambda s: s is not None and s.desired == 1, low, 600)
        draining = watch.until(lambda s: watch.draining() is not None or bool(s and s.retired), low, 600)
        in_flight = watch.draining() or 0
        retired = watch.until(
            lambda s: (s is not None and bool(s.retired)) or len(watch.scaler.workers()) == 1, low, 600
        )
        gone = watch.until(lambda s: len(watch.scaler.workers()) == 1 and not watch.scaler.stopping(), low, 600)
        for event in stops:
            event.set()
        for thread in threads:
            thread.join(timeout=300)
        channel.close()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed while scaling, the first: {failed[0]}")
    return {
        "decision_s": decided,
        "new_worker_registered_s": registered,
        "measured_cold_start_s": cold_start,
        "new_worker_serving_s": serving,
        "scale_down_decision_s": down,
        "drain_started_s": draining,
        "in_flight_at_drain": in_flight,
        "drained_and_retired_s": retired,
        "worker_gone_s": gone,
        "drain_s": retired - draining,
        "requests_completed": done[0],
    }


def main() -> None:
    args = parse_args()
    rounds = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="autoscale-live-") as tmp:
            print(f"round {r + 1}/{args.rounds} ({args.policy})", flush=True)
            log_dir = args.log_dir / f"round-{r + 1}" if args.log_dir else Path(tmp) / "logs"
            rounds.append(one_round(args, Path(tmp), log_dir))
            print(json.dumps(rounds[-1], indent=2), flush=True)
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    report = {
        "policy": args.policy,
        "clients": args.clients,
        "interval_s": args.interval_s,
        "scale_down_window_s": args.scale_down_window_s,
        "rounds": rounds,
        "median": medians,
    }
    print(
        "\nfrom the load step:   decision {decision_s:.1f}s, new worker registered {new_worker_registered_s:.1f}s "
        "(cold start {measured_cold_start_s:.1f}s), serving {new_worker_serving_s:.1f}s".format(**medians)
    )
    print(
        "from the load's fall: decision {scale_down_decision_s:.1f}s, draining {in_flight_at_drain:.0f} requests, "
        "retired {drained_and_retired_s:.1f}s (drain {drain_s:.1f}s), process gone {worker_gone_s:.1f}s; "
        "{requests_completed:.0f} requests, none failed".format(**medians)
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
