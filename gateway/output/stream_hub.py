"""The gateway's one Subscribe stream: every live request's output, one TokenBatch per engine step.

The hub registers the requests this gateway streams, hands each batch to the output processor
(output_processor.py), which makes every request's chunks, and cancels upstream the requests the
gateway ends itself or whose consumer left. A resumed request starts from its record
(record_replay.py). If the scheduler restarts or drops a slow subscriber, the hub reconnects with
backoff and catches up every live request from its persisted record (Scheduler.GetRequest); offsets
make duplicates harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from gateway.output.output_processor import OutputProcessor
from gateway.output.record_replay import record_delta, restore_held_back
from gateway.output.request_stream import RequestStream
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0


class StreamHub:
    """Consumes this gateway's Subscribe stream and feeds each live request's queue."""

    def __init__(self, gateway_id: str, backends: Backends, local_detokenize: bool = True) -> None:
        self._gateway_id = gateway_id
        self._backends = backends
        self.processor = OutputProcessor(backends, local_detokenize, self._cancel_upstream)
        # One batch (or one Resume record) at a time: each changes the prefix and pending of its requests.
        self._lock = asyncio.Lock()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._unsent_cancels: set[str] = set()  # cancels the scheduler could not take, sent again on resubscribe

    def start(self) -> None:
        self._task = asyncio.create_task(self._subscribe_forever(), name="stream-hub")

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._background) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Whether the subscription is (or becomes, within `timeout_s`) open."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def register(self, stream: RequestStream) -> None:
        """Start routing `stream.request_id`'s deltas to `stream.queue`; call before Submit or Attach."""
        self.processor.add(stream)

    def release(self, request_id: str, cancel: bool = True, grace_s: float = 0.0) -> None:
        """The consumer is gone: stop routing, and cancel the request upstream if it is still running.

        With `grace_s`, the cancel waits that long and is dropped if a client resumed the request on
        this gateway meanwhile (one that resumed it on another gateway owns it: the scheduler ignores
        this gateway's cancel then).
        """
        stream = self.processor.remove(request_id)
        if stream is None or stream.finished or not cancel:
            return
        if grace_s > 0:
            self._spawn(self._cancel_unless_resumed(request_id, grace_s))
        else:
            self._cancel_upstream(request_id)

    async def _cancel_unless_resumed(self, request_id: str, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        if self.processor.get(request_id) is None:
            await self._cancel(request_id)

    async def apply_record(self, request_id: str, info: common_pb2.RequestInfo, offset: int) -> RequestStream:
        """Start a registered, resumed stream at output `offset` from the request's record, then let
        the deltas held meanwhile in."""
        async with self._lock:
            stream = self.processor.get(request_id)
            assert stream is not None, "apply_record follows register"
            await restore_held_back(self._backends, stream, info, offset)
            stream.next_offset = offset
            deltas = [record_delta(info, offset), *(stream.buffered or ())]
            stream.buffered = None
            await self.processor.process(deltas)
            return stream

    async def _subscribe_forever(self) -> None:
        backoff = _FIRST_BACKOFF_S
        request = scheduler_pb2.SubscribeRequest(gateway_id=self._gateway_id)
        while True:
            await self._backends.scheduler_ready()
            call = self._backends.scheduler.Subscribe(request)
            try:
                # The scheduler sends its initial metadata once the subscription is registered: a Submit
                # (or a catch-up read) before that could have its deltas relayed to nobody.
                await call.initial_metadata()
                self._connected.set()
                logger.info("subscribed to the scheduler as %s", self._gateway_id)
                backoff = _FIRST_BACKOFF_S
                await self._catch_up()
                async for batch in call:
                    async with self._lock:
                        await self.processor.process(batch.deltas)
                logger.warning("the scheduler closed the subscription; reconnecting")
            except grpc.aio.AioRpcError as exc:
                logger.warning("subscription lost (%s: %s); reconnecting", exc.code().name, exc.details())
            except Exception:
                # A bug must not end the only stream every request depends on: log it, resubscribe, catch up.
                logger.exception("stream hub failed; resubscribing")
            finally:
                self._connected.clear()
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _catch_up(self) -> None:
        for request_id in list(self._unsent_cancels):
            self._cancel_upstream(request_id)
        # Tokens persisted while the stream was down never reach it: read them from the records.
        ids = self.processor.followed()
        records = await asyncio.gather(*(self._record(rid) for rid in ids), return_exceptions=True)
        deltas = []
        for rid, record in zip(ids, records):
            stream = self.processor.get(rid)
            if stream is None or isinstance(record, BaseException):
                continue
            if record is None:
                deltas.append(
                    common_pb2.RequestDelta(
                        request_id=rid,
                        offset=stream.next_offset,
                        finish_reason=sampling_pb2.FINISH_REASON_ERROR,
                        error="the scheduler has no record of this request any more",
                    )
                )
            else:
                deltas.append(record_delta(record, stream.next_offset))
        async with self._lock:
            await self.processor.process(deltas)

    async def _record(self, request_id: str) -> common_pb2.RequestInfo | None:
        try:
            return await self._backends.scheduler.GetRequest(
                common_pb2.GetRequestRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def _cancel_upstream(self, request_id: str) -> None:
        self._spawn(self._cancel(request_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str) -> None:
        try:
            # Our gateway id: if a client has resumed the request on another gateway, it runs on.
            await self._backends.scheduler.Cancel(
                common_pb2.CancelRequest(request_id=request_id, gateway_id=self._gateway_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                # The scheduler is down or restarting: it will recover the request from Redis and run
                # it for nobody. The cancel goes again once the subscription is back (_catch_up).
                self._unsent_cancels.add(request_id)
            logger.warning("cancel of %s failed: %s %s", request_id, exc.code().name, exc.details())
            return
        self._unsent_cancels.discard(request_id)
