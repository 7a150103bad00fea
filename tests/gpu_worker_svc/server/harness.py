"""A scheduler stand-in and a Session client, to drive a real worker process.

The stand-in answers RegisterWorker and Heartbeat like the scheduler does;
`SessionClient` is the scheduler's end of `Worker.Session`.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.duration_pb2 import Duration

from shardline.proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[3]
HEARTBEAT_S = 0.2


class SchedulerStandIn(scheduler_pb2_grpc.SchedulerServicer):
    """Records registrations and heartbeats; `forget()` plays a restarted scheduler."""

    def __init__(self) -> None:
        self.registrations: queue.Queue[worker_pb2.WorkerInfo] = queue.Queue()
        self.heartbeats: queue.Queue[scheduler_pb2.HeartbeatRequest] = queue.Queue()
        self._known: set[str] = set()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def RegisterWorker(self, request, context):
        self._known.add(request.worker.worker_id)
        self.registrations.put(request.worker)
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval=Duration(nanos=int(HEARTBEAT_S * 1e9)))

    def Heartbeat(self, request, context):
        self.heartbeats.put(request)
        return scheduler_pb2.HeartbeatResponse(registered=request.worker_id in self._known)

    def forget(self, worker_id: str) -> None:
        self._known.discard(worker_id)

    def wait_for_heartbeat(self, accept, timeout_s: float = 20.0) -> scheduler_pb2.HeartbeatRequest:
        """The first heartbeat from now on that `accept` likes."""
        while not self.heartbeats.empty():
            self.heartbeats.get_nowait()
        deadline = time.monotonic() + timeout_s
        while True:
            beat = self.heartbeats.get(timeout=max(0.0, deadline - time.monotonic()))
            if accept(beat):
                return beat

    def stop(self) -> None:
        self._server.stop(0)


class SessionClient:
    """One Session stream; commands are sent as the test goes, outputs read by a thread."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._commands: queue.Queue[worker_pb2.WorkerCommand | None] = queue.Queue()
        self.call = worker_pb2_grpc.WorkerStub(self._channel).Session(iter(self._commands.get, None))
        self._outputs: queue.Queue[worker_pb2.StepOutput | grpc.RpcError | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for out in self.call:
                self._outputs.put(out)
            self._outputs.put(None)
        except grpc.RpcError as exc:
            self._outputs.put(exc)

    def send(self, add: list[worker_pb2.NewRequest] = (), abort: list[str] = ()) -> None:
        self._commands.put(worker_pb2.WorkerCommand(add=add, abort=abort))

    def next(self, timeout_s: float = 30.0) -> worker_pb2.StepOutput:
        item = self._outputs.get(timeout=timeout_s)
        if not isinstance(item, worker_pb2.StepOutput):
            raise AssertionError(f"the session ended: {item}")
        return item

    def until_finished(self, request_ids: set[str], timeout_s: float = 60.0) -> list[worker_pb2.StepOutput]:
        """Every StepOutput until each of `request_ids` got its final delta."""
        steps, pending = [], set(request_ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            steps.append(self.next(max(0.1, deadline - time.monotonic())))
            pending -= {d.request_id for d in steps[-1].deltas if d.finish_reason}
        return steps

    def end(self, timeout_s: float = 30.0) -> grpc.RpcError | None:
        """How the stream ended (None: cleanly), skipping outputs still queued."""
        deadline = time.monotonic() + timeout_s
        while True:
            item = self._outputs.get(timeout=max(0.1, deadline - time.monotonic()))
            if not isinstance(item, worker_pb2.StepOutput):
                return item

    def close(self) -> None:
        self.call.cancel()
        self._commands.put(None)
        self._channel.close()


def new_request(request_id: str, prompt: list[int], max_tokens: int, **params) -> worker_pb2.NewRequest:
    params.setdefault("temperature", 0.0)
    return worker_pb2.NewRequest(
        request_id=request_id, prompt_token_ids=prompt, params={"max_tokens": max_tokens, "ignore_eos": True, **params}
    )


def tokens_by_request(steps: list[worker_pb2.StepOutput]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for step in steps:
        for d in step.deltas:
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


def final_deltas(steps: list[worker_pb2.StepOutput]) -> dict[str, common_pb2.RequestDelta]:
    return {d.request_id: d for s in steps for d in s.deltas if d.finish_reason}


class WorkerProcess:
    """`python -m gpu_worker_svc.server.main` with its log in a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        env = {**os.environ, "SHARDLINE_TRACING": "0", "PYTHONUNBUFFERED": "1"}
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_worker_svc.server.main", *args],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_registered(self, scheduler: SchedulerStandIn, timeout_s: float = 90.0) -> worker_pb2.WorkerInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return scheduler.registrations.get(timeout=0.2)
            except queue.Empty:
                pass
        raise AssertionError(f"worker did not register in {timeout_s}s:\n{self.log()}")

    def log(self, tail: int | None = 4000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
