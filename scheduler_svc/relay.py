"""Fan-out of token batches to the gateways' Subscribe streams."""

import asyncio
import logging
from collections.abc import AsyncIterator

from shardline.core.errors import Unavailable
from shardline.proto import scheduler_pb2

log = logging.getLogger(__name__)


class Subscription:
    """One gateway's Subscribe stream: a bounded queue of TokenBatches.

    Publishing never waits: a gateway that lets its queue fill is cut off (its
    stream ends UNAVAILABLE) rather than stalling the worker streams that feed
    every other gateway. Everything it missed is in Redis, by offset.
    """

    def __init__(self, gateway_id: str, maxsize: int) -> None:
        self.gateway_id = gateway_id
        # Bounded by offer(), not by the queue: the end marker must always fit behind the batches.
        self._queue: asyncio.Queue[scheduler_pb2.TokenBatch | None] = asyncio.Queue()
        self._maxsize = maxsize
        self._error: str | None = None
        self.closed = False

    def offer(self, batch: scheduler_pb2.TokenBatch) -> None:
        if self._queue.qsize() >= self._maxsize:
            self.close(f"gateway {self.gateway_id} fell {self._maxsize} batches behind: re-subscribe")
        else:
            self._queue.put_nowait(batch)

    def close(self, error: str | None = None) -> None:
        """Ends the stream once its queue is read, or at once with `error`."""
        if self.closed:
            return
        self.closed, self._error = True, error
        if error is not None:
            while not self._queue.empty():
                self._queue.get_nowait()
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[scheduler_pb2.TokenBatch]:
        while (batch := await self._queue.get()) is not None:
            yield batch
        if self._error is not None:
            raise Unavailable(self._error)


class Relay:
    """The live Subscribe stream of each gateway; a new Subscribe with the same id replaces the old one."""

    def __init__(self, queue_size: int) -> None:
        self._queue_size = queue_size
        self._subscriptions: dict[str, Subscription] = {}
        self.dropped_batches = 0  # batches for gateways with no stream; they recover from Redis

    def subscribe(self, gateway_id: str) -> Subscription:
        old = self._subscriptions.get(gateway_id)
        if old is not None:
            old.close("replaced by a newer Subscribe with the same gateway_id")
        subscription = Subscription(gateway_id, self._queue_size)
        self._subscriptions[gateway_id] = subscription
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Forgets a stream that ended, unless a newer one already took its place."""
        subscription.close()
        if self._subscriptions.get(subscription.gateway_id) is subscription:
            del self._subscriptions[subscription.gateway_id]

    def publish(self, gateway_id: str, batch: scheduler_pb2.TokenBatch) -> None:
        subscription = self._subscriptions.get(gateway_id)
        if subscription is None or subscription.closed:
            self.dropped_batches += 1
            log.debug("no Subscribe stream for gateway %s: dropped a batch of %d deltas", gateway_id, len(batch.deltas))
            return
        subscription.offer(batch)

    def close_all(self) -> None:
        for subscription in list(self._subscriptions.values()):
            subscription.close()
        self._subscriptions.clear()
