"""Keeps this worker in the scheduler's pool: register, then heartbeat."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from gpu_worker_svc.server.engine_loop import WorkerLoad
from shardline.core.grpc_server import GRPC_OPTIONS
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from tracing.grpc_context import aio_client_interceptors

log = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 5.0
_FIRST_RETRY_S = 0.2
_MAX_RETRY_S = 5.0
# Used when the scheduler's answer leaves the interval unset.
_DEFAULT_HEARTBEAT_S = 2.0


class SchedulerRegistration:
    """Registers with retry and backoff until the scheduler answers, then heartbeats the worker's load.

    A heartbeat answered with registered=false (the scheduler restarted and
    forgot us) registers again; failed heartbeats are logged and retried at the
    next interval, since the scheduler notices a dead worker on its own.

    A heartbeat answered with retired=true (the autoscaler drained this worker and took it out of
    the pool) ends the loop: `on_retired` stops the worker serving, and it waits, registered
    nowhere, for the driver that scales the pool to stop it.
    """

    def __init__(
        self,
        address: str,
        info: worker_pb2.WorkerInfo,
        load: Callable[[], WorkerLoad],
        on_retired: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._address = address
        self._info = info
        self._load = load
        self._on_retired = on_retired

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(
            self._address, options=GRPC_OPTIONS, interceptors=aio_client_interceptors()
        ) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            interval = await self._register(stub)
            while True:
                await asyncio.sleep(interval)
                load = self._load()
                try:
                    reply = await stub.Heartbeat(
                        scheduler_pb2.HeartbeatRequest(
                            worker_id=self._info.worker_id,
                            running=load.running,
                            waiting=load.waiting,
                            kv_blocks_used=load.kv_blocks_used,
                        ),
                        timeout=_RPC_TIMEOUT_S,
                    )
                except grpc.aio.AioRpcError as exc:
                    log.warning("heartbeat to %s failed: %s %s", self._address, exc.code().name, exc.details())
                    continue
                if reply.retired:
                    log.info(
                        "scheduler %s retired this worker: no longer serving, waiting to be stopped", self._address
                    )
                    if self._on_retired is not None:
                        await self._on_retired()
                    return
                if not reply.registered:
                    log.warning("scheduler %s no longer knows this worker: registering again", self._address)
                    interval = await self._register(stub)

    async def leave(self, grace_s: float) -> None:
        """Asks the scheduler to move this stopping worker's requests, their KV blocks sent ahead
        (Scheduler.DrainWorker), and waits at most `grace_s` for it. Whatever goes wrong is logged and
        the worker stops anyway: its requests then re-prefill elsewhere from their tokens in Redis."""
        if grace_s <= 0:
            log.warning("stopping without a KV hand-off (stop_handoff_s is 0): the requests re-prefill elsewhere")
            return
        async with grpc.aio.insecure_channel(
            self._address, options=GRPC_OPTIONS, interceptors=aio_client_interceptors()
        ) as channel:
            try:
                reply = await scheduler_pb2_grpc.SchedulerStub(channel).DrainWorker(
                    scheduler_pb2.DrainWorkerRequest(worker_id=self._info.worker_id), timeout=grace_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # retired, or never registered: it holds nothing
                    log.info("stopping: scheduler %s has no requests on this worker", self._address)
                    return
                log.warning(
                    "stopping: the KV hand-off through scheduler %s failed (%s %s); the requests re-prefill elsewhere",
                    self._address,
                    exc.code().name,
                    exc.details(),
                )
                return
        if reply.handed_off < reply.moved:
            log.warning(
                "stopping: %d of %d requests moved without their KV blocks and re-prefill elsewhere",
                reply.moved - reply.handed_off,
                reply.moved,
            )
        else:
            log.info("stopping: %d requests moved with their KV blocks", reply.moved)

    async def _register(self, stub: scheduler_pb2_grpc.SchedulerStub) -> float:
        """Register until it succeeds; returns the heartbeat interval in seconds."""
        delay = _FIRST_RETRY_S
        while True:
            try:
                reply = await stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker=self._info), timeout=_RPC_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "registering with scheduler %s failed (%s %s); retrying in %.1fs",
                    self._address,
                    exc.code().name,
                    exc.details(),
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_S)
                continue
            interval = reply.heartbeat_interval.ToTimedelta().total_seconds() or _DEFAULT_HEARTBEAT_S
            log.info(
                "registered %s with scheduler %s; heartbeat every %.1fs", self._info.worker_id, self._address, interval
            )
            return interval
