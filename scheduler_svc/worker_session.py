"""The scheduler's client end of one worker's `Worker.Session` stream."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from shardline.core.errors import Unavailable
from shardline.core.grpc_server import GRPC_OPTIONS
from shardline.core.store.request_store import StoreUnavailable
from shardline.proto import worker_pb2, worker_pb2_grpc
from tracing.grpc_context import aio_client_interceptors

log = logging.getLogger(__name__)

# Called with the worker id, the StepOutputs that arrived since the last call, in order, and a count
# of the steps that arrived after them (what waits while a Redis outage holds the call).
StepsHandler = Callable[[str, list[worker_pb2.StepOutput], Callable[[], int]], Awaitable[None]]
# Called once with the worker id and why its stream ended, after every step received was handled.
LostHandler = Callable[[str, str], Awaitable[None]]


class WorkerSession:
    """Streams WorkerCommands to a worker and hands its StepOutputs on.

    Reading the stream never waits on Redis: a reader task only queues what
    arrives, and a handler task drains the queue, passing every step that
    piled up meanwhile in one call. The end of the stream (or an error on it)
    is queued behind the steps, so the death handler runs only after every
    token the worker sent has been persisted and relayed.

    A batch of steps that cannot be recorded (Redis down for longer than the scheduler waits) ends
    the session: its tokens, and those of every step after it, are not relayed, and the death
    handler re-queues the worker's requests from what Redis holds. No token reaches a gateway that
    Redis does not have, and none is dropped from a request that runs on.
    """

    def __init__(self, worker_id: str, channel: grpc.aio.Channel, on_steps: StepsHandler, on_lost: LostHandler) -> None:
        self.worker_id = worker_id
        self._channel = channel
        self._on_steps = on_steps
        self._on_lost = on_lost
        # None ends the stream of commands, once the session is over.
        self._commands: asyncio.Queue[worker_pb2.WorkerCommand | None] = asyncio.Queue()
        self._steps: asyncio.Queue[worker_pb2.StepOutput | str] = asyncio.Queue()
        self._close_reason: str | None = None  # set when the scheduler itself ends the session
        self._unrecorded = False  # a batch of steps could not be recorded: the ones after it are dropped
        self.migrated = False  # the scheduler ended it to move the worker's requests elsewhere
        # The commands as the call's request iterator, which the session ends itself: with write(),
        # grpc's own iterator task would be left pending on a stream that broke, and then destroyed.
        self._call = worker_pb2_grpc.WorkerStub(channel).Session(self._outgoing())
        self._tasks = [
            asyncio.create_task(self._read(), name=f"session-read-{worker_id}"),
            asyncio.create_task(self._handle(), name=f"session-handle-{worker_id}"),
        ]

    @classmethod
    async def open(
        cls, info: worker_pb2.WorkerInfo, on_steps: StepsHandler, on_lost: LostHandler, connect_timeout_s: float
    ) -> "WorkerSession":
        """Connects to the worker and opens its stream; Unavailable when the address does not answer,
        so a worker that advertises a wrong address fails to register instead of burning dispatch attempts."""
        channel = grpc.aio.insecure_channel(info.address, options=GRPC_OPTIONS, interceptors=aio_client_interceptors())
        try:
            await asyncio.wait_for(channel.channel_ready(), connect_timeout_s)
        except TimeoutError:
            await channel.close()
            raise Unavailable(
                f"worker.address: cannot connect to {info.address} within {connect_timeout_s:.1f}s"
            ) from None
        return cls(info.worker_id, channel, on_steps, on_lost)

    @property
    def unrecorded(self) -> bool:
        """The session ended because its steps could not be recorded (Redis), not by the worker's fault."""
        return self._unrecorded

    def send(self, command: worker_pb2.WorkerCommand) -> None:
        """Queues a command; it is dropped if the stream has already ended."""
        self._commands.put_nowait(command)

    async def close(self, reason: str, migrate: bool = False) -> None:
        """Breaks the stream (the worker is declared dead) and waits for the death handler to finish.

        `migrate`: the worker is fine and leaves the pool; its requests move on without counting
        the move as a failed attempt."""
        self._close_reason = reason
        self.migrated = migrate
        self._call.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Shutdown: drops the stream without running the death handler; Redis keeps the requests RUNNING
        so the next scheduler re-queues them."""
        for task in self._tasks:
            task.cancel()
        self._commands.put_nowait(None)
        self._call.cancel()
        if self._tasks:  # bounded, like the dispatcher's stop: shutdown never hangs on a dead peer
            await asyncio.wait(self._tasks, timeout=5.0)
        await asyncio.wait_for(self._channel.close(), timeout=5.0)

    async def _outgoing(self) -> AsyncIterator[worker_pb2.WorkerCommand]:
        while (command := await self._commands.get()) is not None:
            yield command

    async def _read(self) -> None:
        reason = "the worker closed its Session stream"
        try:
            async for step in self._call:
                self._steps.put_nowait(step)
        except grpc.aio.AioRpcError as exc:
            reason = f"Session stream failed: {exc.code().name}: {exc.details()}"
        finally:
            self._steps.put_nowait(self._close_reason or reason)

    async def _handle(self) -> None:
        while True:
            batch = [await self._steps.get()]
            while not self._steps.empty():
                batch.append(self._steps.get_nowait())
            steps = [item for item in batch if isinstance(item, worker_pb2.StepOutput)]
            if steps and not self._unrecorded:
                try:
                    await self._on_steps(self.worker_id, steps, self._steps.qsize)
                except Exception as exc:
                    log.error(
                        "worker %s: %d steps could not be recorded (%s): ending its session, its "
                        "requests go back to the queue",
                        self.worker_id,
                        len(steps),
                        exc,
                        exc_info=not isinstance(exc, StoreUnavailable),
                    )
                    self._unrecorded = True
                    self._close_reason = self._close_reason or f"its steps could not be recorded: {exc}"
                    self._call.cancel()
            if isinstance(batch[-1], str):
                self._commands.put_nowait(None)
                await self._channel.close()
                try:
                    await self._on_lost(self.worker_id, batch[-1])
                except Exception:
                    log.exception("worker %s: re-queueing its requests failed", self.worker_id)
                return
