"""`shardline up --autoscale POLICY`: the stack's worker processes follow the scheduler's decisions.

The scheduler decides and drains (scheduler_svc/pool_scaler.py); this follower, in the `shardline
up` process, which owns the workers, carries the count out. It reads the scheduler's GetStats and
ListWorkers once a poll, then:
- starts workers while fewer run than the scheduler wants, each under a new id;
- stops the workers the scheduler retired (drained, out of the pool) with SIGTERM;
- when the scheduler has cancelled asks, stops the newest workers still starting: it never stops a
  worker that is registered, since only the scheduler knows when a registered one has drained.
Call check() from the thread that started the stack, as the supervisor's check() (a child dies
with the thread that forked it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from shardline.stack.local_stack import LocalStack

_RPC_TIMEOUT_S = 2.0
_STOP_TIMEOUT_S = 20.0  # how long a stopped worker may take before SIGKILL


@dataclass(slots=True)
class _Stopping:
    proc: subprocess.Popen
    since: float


@dataclass(slots=True)
class LocalWorkerScaler:
    """Starts and stops a LocalStack's workers so that their number follows the scheduler's."""

    stack: LocalStack
    report: Callable[[str], None]  # what it starts and stops, told to the console
    poll_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _next_poll: float = 0.0
    _next_index: int = 0
    _stopping: list[_Stopping] = field(default_factory=list)
    _channel: grpc.Channel | None = None

    def __post_init__(self) -> None:
        self._next_index = len(self.workers())

    def workers(self) -> list[str]:
        """The names (worker ids) of the stack's worker processes."""
        return [child.name for child in self.stack.children if child.name.startswith("worker-")]

    def stopping(self) -> int:
        """Workers sent SIGTERM that have not exited yet."""
        return len(self._stopping)

    def check(self) -> None:
        """Reaps stopped workers; at most once a poll, reads the scheduler and follows it."""
        self._reap()
        now = self.clock()
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_s
        try:
            stats, registered = self._read()
        except grpc.RpcError:  # the scheduler restarting: the next poll reads it again
            return
        for scale in stats.scale:  # one model per stack
            self._follow(scale, registered)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def _read(self) -> tuple[scheduler_pb2.SchedulerStats, dict[str, bool]]:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.stack.config.scheduler_port}")
        stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        stats = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=_RPC_TIMEOUT_S)
        listed = stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=_RPC_TIMEOUT_S)
        return stats, {w.worker.worker_id: w.draining for w in listed.workers}

    def _follow(self, scale: scheduler_pb2.ModelScale, registered: dict[str, bool]) -> None:
        for worker_id in scale.retired:
            if worker_id in self.workers():
                self._stop(worker_id, "retired by the autoscaler")
        # Counted as the scheduler counts: draining workers are on their way out already.
        counted = [name for name in self.workers() if not registered.get(name, False)]
        for _ in range(scale.desired - len(counted)):
            name = f"worker-{self._next_index}"
            self._next_index += 1
            self.stack.add_worker(int(name.removeprefix("worker-")))
            self.report(f"autoscaler: starting {name} ({scale.reason})")
        starting = [name for name in counted if name not in registered]
        surplus = min(len(starting), max(0, len(counted) - scale.desired))
        for name in reversed(starting[len(starting) - surplus :]):  # the newest first
            self._stop(name, "no longer wanted while starting")

    def _stop(self, name: str, why: str) -> None:
        self._stopping.append(_Stopping(self.stack.remove(name), self.clock()))
        self.report(f"autoscaler: stopping {name} ({why})")

    def _reap(self) -> None:
        now = self.clock()
        for stopping in list(self._stopping):
            if stopping.proc.poll() is not None:
                self._stopping.remove(stopping)
            elif now - stopping.since > _STOP_TIMEOUT_S:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(stopping.proc.pid, signal.SIGKILL)  # its tensor-parallel ranks too
