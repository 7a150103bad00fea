"""The `shardline.v1.Worker` gRPC service."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from gpu_worker_svc.model.lora_adapter import LoraAdapterError, LoraAdapterInUse
from gpu_worker_svc.server.engine_loop import EngineLoop, SessionEnd, SessionLink
from shardline.core.errors import FailedPrecondition, InvalidArgument, NotFound, ShardlineError, Unavailable
from shardline.proto import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Bridges Session streams to the engine thread.

    The scheduler's commands go to the engine's inbox as they arrive; the
    engine's StepOutputs are streamed back in order. The session ends, and its
    requests are aborted, when the client cancels or half-closes the stream.
    A newer session replaces it, and the worker ends it with UNAVAILABLE when
    it shuts down or its engine dies.
    """

    def __init__(self, engine_loop: EngineLoop, info: worker_pb2.WorkerInfo) -> None:
        self._engine_loop = engine_loop
        self._info = info
        self._session_ids = itertools.count(1)

    async def GetInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self._info

    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoraAdaptersResponse:
        engine = self._engine_loop.engine
        try:
            # Read and checked off the engine's thread; only putting it in place waits for a step's end.
            adapter = await asyncio.to_thread(engine.loras.read, request.lora_name, request.lora_path)
            _, names = await asyncio.wrap_future(
                self._engine_loop.call(lambda e: (e.serve_lora(adapter), e.loras.names))
            )
        except LoraAdapterError as exc:
            raise _refusal(exc) from None
        return self._adapters_now(names)

    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoraAdaptersResponse:
        name = request.lora_name
        try:
            removed, names = await asyncio.wrap_future(
                self._engine_loop.call(lambda e: (e.remove_lora(name), e.loras.names))
            )
        except LoraAdapterError as exc:
            raise _refusal(exc) from None
        if not removed:
            raise NotFound(f"lora_name: LoRA adapter {name!r} is not served here")
        return self._adapters_now(names)

    def _adapters_now(self, names: list[str]) -> common_pb2.LoraAdaptersResponse:
        """The served adapters, also in the info the worker registers with (GetInfo, a re-registration)."""
        del self._info.adapters[:]
        self._info.adapters.extend(names)
        return common_pb2.LoraAdaptersResponse(adapters=names)

    async def Session(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerCommand], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepOutput]:
        link = SessionLink(next(self._session_ids), asyncio.get_running_loop(), asyncio.Queue())
        log.info("session %d opened by %s", link.id, context.peer())
        self._engine_loop.open_session(link)
        reader = asyncio.create_task(self._read_commands(request_iterator, link))
        try:
            while True:
                item = await link.queue.get()
                if isinstance(item, SessionEnd):
                    if item.error is not None:
                        raise Unavailable(item.error)
                    return
                yield item
        finally:
            reader.cancel()
            self._engine_loop.close_session(link.id)
            log.info("session %d closed", link.id)

    async def _read_commands(self, commands: AsyncIterator[worker_pb2.WorkerCommand], link: SessionLink) -> None:
        try:
            async for command in commands:
                self._engine_loop.submit(link.id, command)
        except grpc.aio.AioRpcError as exc:  # the client went away; the rpc itself is cancelled too
            log.info("session %d stream broke: %s", link.id, exc.code().name)
        link.queue.put_nowait(SessionEnd(None))


def _refusal(exc: LoraAdapterError) -> ShardlineError:
    """An adapter refused at load or unload, as its gRPC status: the field at fault named first."""
    problem = f"LoRA adapter {exc.adapter!r}: {exc.problem}"
    return (
        FailedPrecondition(exc.field, problem)
        if isinstance(exc, LoraAdapterInUse)
        else InvalidArgument(exc.field, problem)
    )
