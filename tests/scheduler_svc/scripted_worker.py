"""A scripted `Worker` service: the scheduler's real gRPC peer, minus the model.

It registers with the scheduler, accepts the Session stream, and emits one
StepOutput per tick with one deterministic token per running request: token i
of a request is a function of (seed, i), as the real engine's sampling is, so a
request resumed after a failover must continue with exactly the tokens an
unbroken run would give. Tests pause it, read what it received, and kill it to
inject faults at the gRPC boundary.
"""

import asyncio
from dataclasses import dataclass, field

import grpc

from shardline.core.grpc_server import GrpcService, start_grpc_server
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
KV_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["KvTransfer"].full_name


def token_at(seed: int, index: int) -> int:
    """The token an unbroken run samples at output index `index`."""
    return 1000 + (seed * 31 + index * 7) % 997


class ScriptedKvTransfer(worker_pb2_grpc.KvTransferServicer):
    """Records the KV sends and remote prefills it is asked for; with `refuse`, answers each with
    UNAVAILABLE; each one takes `delay_s`, as a long context's blocks take time to compute and move."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sends: list[worker_pb2.SendBlocksRequest] = []
        self.prefills: list[worker_pb2.PrefillBlocksRequest] = []
        self.refuse = False
        self.delay_s = 0.0

    async def PrefillBlocks(self, request, context):
        self.prefills.append(request)
        await asyncio.sleep(self.delay_s)
        if self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker stopping")
        return worker_pb2.PushBlocksResult(imported=len(request.token_ids) // self.block_size)

    async def SendBlocks(self, request, context):
        self.sends.append(request)
        await asyncio.sleep(self.delay_s)
        if self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target 127.0.0.1:1: connection refused")
        return worker_pb2.PushBlocksResult(imported=3)


@dataclass(slots=True)
class _Running:
    new: worker_pb2.NewRequest  # as received
    output: list[int] = field(default_factory=list)  # prefilled + generated tokens


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """A fake worker for component tests (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        max_num_seqs: int = 4,
        block_size: int = 4,
        model: str = "test-model",
        tick_s: float = 0.01,
        heartbeat_s: float | None = 0.1,
        max_model_len: int = 0,
        reregister: bool = False,
        role: str = "",
    ) -> None:
        self.info = worker_pb2.WorkerInfo(
            worker_id=worker_id,
            model=model,
            tp_size=1,
            kv_blocks_total=64,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            role=role,
        )
        self.tick_s = tick_s
        self.reregister = reregister  # registers again when a heartbeat says the scheduler forgot it
        self.heartbeat_s = heartbeat_s
        self.received: list[worker_pb2.NewRequest] = []  # every NewRequest, in arrival order
        self.aborted: list[str] = []  # every abort received
        self.add_sizes: list[int] = []  # how many NewRequests each WorkerCommand carried
        self.running: dict[str, _Running] = {}
        self.generating = asyncio.Event()  # cleared: requests are held, no tokens come out
        self.generating.set()
        self.step = 0
        self._aborts: list[str] = []
        self._server = None
        self._channel: grpc.aio.Channel | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self.session_ended = asyncio.Event()
        self.retired = asyncio.Event()  # a heartbeat said the autoscaler took it out of the pool
        self.kv = ScriptedKvTransfer(block_size)  # its KvTransfer service

    async def start(self, scheduler_port: int) -> "ScriptedWorker":
        self._server = await start_grpc_server(
            [
                GrpcService(self, worker_pb2_grpc.add_WorkerServicer_to_server, WORKER_SERVICE),
                GrpcService(self.kv, worker_pb2_grpc.add_KvTransferServicer_to_server, KV_SERVICE),
            ],
            0,
            "127.0.0.1",
        )
        self.info.address = f"127.0.0.1:{self._server.port}"
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_port}")
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel)
        await self.scheduler.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=self.info))
        if self.heartbeat_s is not None:
            self._heartbeat_task = asyncio.create_task(self._heartbeat())
        return self

    async def kill(self) -> None:
        """Dies abruptly: the Session stream breaks and heartbeats stop."""
        self.stop_heartbeats()
        await self._server.server.stop(0)
        await self._channel.close()

    def stop_heartbeats(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            reply = await self.scheduler.Heartbeat(
                scheduler_pb2.HeartbeatRequest(worker_id=self.info.worker_id, running=len(self.running))
            )
            if reply.retired:  # as the real worker does: no longer registering, waiting to be stopped
                self.retired.set()
                return
            if not reply.registered and self.reregister:  # as the real worker does: a new session
                self.running.clear()
                self._aborts.clear()
                try:
                    await self.scheduler.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=self.info))
                except grpc.aio.AioRpcError:
                    pass  # tried again at the next heartbeat, as the real worker's backoff does

    async def Session(self, request_iterator, context):
        reader = asyncio.create_task(self._read_commands(request_iterator))
        try:
            while True:
                await asyncio.sleep(self.tick_s)
                step = self._step()
                if step is not None:
                    yield step
        finally:
            reader.cancel()
            self.session_ended.set()

    async def _read_commands(self, request_iterator) -> None:
        async for command in request_iterator:
            if command.add:
                self.add_sizes.append(len(command.add))
            for new in command.add:
                self.received.append(new)
                self.running[new.request_id] = _Running(new, list(new.output_token_ids))
            self.aborted.extend(command.abort)
            self._aborts.extend(command.abort)

    def _step(self) -> worker_pb2.StepOutput | None:
        deltas = []
        for request_id in self._aborts:
            if (request := self.running.pop(request_id, None)) is not None:
                deltas.append(
                    common_pb2.RequestDelta(
                        request_id=request_id,
                        offset=len(request.output),
                        finish_reason=sampling_pb2.FINISH_REASON_ABORT,
                    )
                )
        self._aborts.clear()
        if self.generating.is_set():
            for request_id, request in list(self.running.items()):
                offset = len(request.output)
                token = token_at(request.new.params.seed, offset)
                request.output.append(token)
                delta = common_pb2.RequestDelta(request_id=request_id, token_ids=[token], offset=offset)
                if len(request.output) >= request.new.params.max_tokens:
                    delta.finish_reason = sampling_pb2.FINISH_REASON_LENGTH
                    del self.running[request_id]
                deltas.append(delta)
        if not deltas:
            return None
        self.step += 1
        return worker_pb2.StepOutput(
            step=self.step,
            deltas=deltas,
            stats=worker_pb2.StepStats(batch_size=len(deltas), num_running=len(self.running)),
        )
