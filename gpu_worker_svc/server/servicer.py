"""The `shardline.v1.Worker` gRPC service."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from gpu_worker_svc.server.engine_loop import EngineLoop, SessionEnd, SessionLink
from shardline.core.errors import Unavailable
from shardline.proto import worker_pb2, worker_pb2_grpc

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
